"""The policy file, read into plain specs that still know where each part was written.

This is the *shape* check: which fields exist, which kinds of values they take,
which node kind a filter node is. Each node kind and scorer kind reads its own
fields (``policyd.policy.kinds``). Meaning (CEL types, node references, cycles,
unused params) is the compiler's job (``policyd.policy.compiler``). The JSON
Schema in ``policy.schema.json`` describes the same shape for editors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from policyd.policy.diagnostics import Diagnostic
from policyd.policy.flow import FlowSpec, read_flow
from policyd.policy.kinds import NODE_KINDS, PICKERS, SCORER_KINDS
from policyd.policy.nodes import NodeSpec
from policyd.policy.reader import (
    IDENTIFIER,
    Expression,
    Fields,
    expression,
    is_int,
    parse_duration,
    scalar_value,
    string_map,
    text,
)
from policyd.policy.scoring import ScorerSpec
from policyd.policy.source import (
    Source,
    YMapping,
    YNode,
    YScalar,
    YSequence,
    kind_name,
    parse_yaml,
)
from policyd.policy.version import API_VERSION, KIND

CRITICALITIES: Final = ("critical", "standard", "sheddable")
PARAM_TYPES: Final = (
    "int",
    "double",
    "string",
    "bool",
    "duration",
    "list<string>",
    "list<int>",
    "list<double>",
    "map<string,string>",
)
DEFAULT_CRITICALITY_HEADER: Final = "x-gateway-inference-criticality"

_TOP_LEVEL: Final = (
    "apiVersion",
    "kind",
    "name",
    "description",
    "match",
    "pool",
    "criticality",
    "models",
    "params",
    "variables",
    "filters",
    "score",
    "pick",
    "shadows",
    "flow",
    "prefill",
)
_PREFILL_FIELDS: Final = ("description", "when", "filters", "score", "pick")


@dataclass(frozen=True, slots=True, eq=False)
class ParamSpec:
    name: str
    key: YScalar
    type: str
    value: object
    valid: bool = True  # False: declared with its type (so CEL still checks) but no value


@dataclass(frozen=True, slots=True, eq=False)
class VariableSpec:
    name: str
    key: YScalar
    expression: Expression


@dataclass(frozen=True, slots=True, eq=False)
class ModelSpec:
    """Per-model settings: default criticality and the traffic split."""

    name: str
    key: YScalar
    criticality: str | None
    targets: tuple[tuple[str, int], ...]  # (target model, weight); empty: no rewrite


@dataclass(frozen=True, slots=True, eq=False)
class ShadowRef:
    """A shadow policy named by a policy: its file, as written (relative to the policy)."""

    file: str
    node: YScalar


@dataclass(frozen=True, slots=True, eq=False)
class PrefillSpec:
    """A policy's ``prefill`` section: when to split, and how to pick the prefill pod.

    ``when`` is the CEL predicate over the request and the decode pod (None
    when it could not be read); the rest is a stage like the policy's own:
    its filter tree, scorers and picker, over the prefill-capable pods.
    """

    key: YScalar
    description: str
    when: Expression | None
    nodes: tuple[NodeSpec, ...]
    broken: frozenset[str]
    scorers: tuple[ScorerSpec, ...]
    pick_strategy: str
    pick_node: YNode | None


@dataclass(frozen=True, slots=True, eq=False)
class PolicySpec:
    source: Source
    name: str
    name_at: tuple[int, int]
    description: str
    models_matched: tuple[str, ...]  # empty: every model
    match_node: YNode | None
    headers: tuple[tuple[str, str], ...]  # exact header conditions, lower-case names
    pool_labels: tuple[tuple[str, str], ...]
    criticality_header: str  # "" when clients cannot choose their criticality
    criticality_default: str
    models: tuple[ModelSpec, ...]
    params: tuple[ParamSpec, ...]
    variables: tuple[VariableSpec, ...]
    nodes: tuple[NodeSpec, ...]  # the first one is where the walk starts
    broken: frozenset[str]  # params, variables (as params.x / variables.x) and nodes
    # that are declared but could not be read: the compiler does not report them again
    scorers: tuple[ScorerSpec, ...]
    pick_strategy: str
    pick_node: YNode | None
    fallbacks: int
    shadows: tuple[ShadowRef, ...] = ()
    shadows_node: YScalar | None = None  # the `shadows` key, where nesting is reported
    flow: FlowSpec | None = None  # flow control: hold requests while the pool is saturated
    prefill: PrefillSpec | None = None  # two stages: the decode pod, then a prefill pod


def read_policy(source: Source) -> tuple[PolicySpec | None, list[Diagnostic]]:
    """Read ``source``; the spec is None when the file is not even a mapping."""
    root, diagnostics = parse_yaml(source)
    if root is None:
        if not diagnostics:
            diagnostics.append(source.diagnostic((1, 1), "empty policy file"))
        return None, diagnostics
    if not isinstance(root, YMapping):
        message = f"a policy file must be a mapping, not {kind_name(root)}"
        return None, [*diagnostics, source.diagnostic(root.at, message)]
    if not _reads_format(root, diagnostics):
        return None, diagnostics
    fields = Fields(root, _TOP_LEVEL, diagnostics, what="the policy")
    name_node = fields.string("name")
    default_name = source.path.rsplit("/", 1)[-1].split(".", 1)[0]
    models_matched, headers, match_node = _read_match(fields)
    pool_labels: tuple[tuple[str, str], ...] = ()
    pool = fields.mapping("pool")
    if pool is not None:
        labels = Fields(pool, ("labels",), diagnostics, what="'pool'").mapping("labels")
        pool_labels = string_map(labels, diagnostics, what="label") if labels else ()
    header, default = _read_criticality(fields)
    strategy, fallbacks = _read_pick(fields, ("strategy", "fallbacks"))
    scorers = _read_scorers(fields)
    broken: set[str] = set()
    spec = PolicySpec(
        source=source,
        name=str(name_node.value) if name_node else default_name,
        name_at=name_node.at if name_node else (1, 1),
        description=text(fields, "description"),
        models_matched=models_matched,
        match_node=match_node,
        headers=headers,
        pool_labels=pool_labels,
        criticality_header=header,
        criticality_default=default,
        models=_read_models(fields),
        params=_read_params(fields, broken),
        variables=_read_variables(fields, broken),
        nodes=_read_nodes(fields, broken),
        broken=frozenset(broken),
        scorers=scorers,
        pick_strategy=strategy or ("max-score" if scorers else "random"),
        pick_node=fields.raw("pick"),
        fallbacks=fallbacks,
        shadows=_read_shadows(fields),
        shadows_node=fields.key("shadows"),
        flow=read_flow(fields),
        prefill=_read_prefill(fields),
    )
    return spec, diagnostics


def _read_pick(fields: Fields, known: tuple[str, ...]) -> tuple[str, int]:
    """``pick``'s strategy ("" when not given) and fallbacks."""
    pick = fields.mapping("pick")
    if pick is None:
        return "", 0
    pick_fields = Fields(pick, known, fields.diagnostics, what="'pick'")
    strategy = pick_fields.choice("strategy", tuple(PICKERS), "")
    return strategy, pick_fields.integer("fallbacks", minimum=0, default=0) or 0


def _read_prefill(fields: Fields) -> PrefillSpec | None:
    """``prefill``: ``when`` to split, and the prefill stage's filters, score and pick.

    Its ``pick`` takes no ``fallbacks``: the decode pod's sidecar is named one
    prefill pod.
    """
    node = fields.mapping("prefill")
    key = fields.key("prefill")
    if node is None or key is None:
        return None
    reader = Fields(node, _PREFILL_FIELDS, fields.diagnostics, what="'prefill'")
    when_node = reader.raw("when")
    when = None
    if when_node is None:
        reader.error(key, "'prefill' needs 'when': the predicate that splits a request")
    else:
        when = expression(reader, when_node, "'when' of 'prefill'")
    broken: set[str] = set()
    nodes = _read_nodes(reader, broken)
    scorers = _read_scorers(reader)
    strategy, _ = _read_pick(reader, ("strategy",))
    return PrefillSpec(
        key=key,
        description=text(reader, "description"),
        when=when,
        nodes=nodes,
        broken=frozenset(broken),
        scorers=scorers,
        pick_strategy=strategy or ("max-score" if scorers else "random"),
        pick_node=reader.raw("pick"),
    )


def _reads_format(root: YMapping, diagnostics: list[Diagnostic]) -> bool:
    """Whether ``apiVersion`` and ``kind`` (each may be absent) name the format read here.

    A file of another format is not read further: its fields would be judged
    by the wrong rules, and its one problem is its version.
    """
    readable = True
    for key, expected in (("apiVersion", API_VERSION), ("kind", KIND)):
        entry = root.entries.get(key)
        if entry is None:
            continue
        value = entry[1]
        if not isinstance(value, YScalar) or value.value != expected:
            shown = f"'{value.value}'" if isinstance(value, YScalar) else kind_name(value)
            message = (
                f"{key} {shown} is not a policy format this policyd reads: "
                f"write '{key}: {expected}' (or leave it out)"
            )
            diagnostics.append(value.source.diagnostic(value.at, message))
            readable = False
    return readable


def _read_shadows(fields: Fields) -> tuple[ShadowRef, ...]:
    """``shadows: [file, ...]``: policies evaluated beside this one, never acted on."""
    sequence = fields.sequence("shadows")
    if sequence is None:
        return ()
    refs: list[ShadowRef] = []
    for item in sequence.items:
        if not isinstance(item, YScalar) or not isinstance(item.value, str) or not item.value:
            fields.error(item, f"a shadow policy is a file name, not {kind_name(item)}")
        elif any(ref.file == item.value for ref in refs):
            fields.error(item, f"shadow policy '{item.value}' is listed twice")
        else:
            refs.append(ShadowRef(item.value, item))
    return tuple(refs)


def _read_match(
    fields: Fields,
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...], YNode | None]:
    match = fields.mapping("match")
    if match is None:
        return (), (), fields.raw("match")
    match_fields = Fields(match, ("models", "headers"), fields.diagnostics, what="'match'")
    models: list[str] = []
    sequence = match_fields.sequence("models")
    if sequence is not None:
        for item in sequence.items:
            if not isinstance(item, YScalar) or not isinstance(item.value, str) or not item.value:
                fields.error(item, f"a model name must be a string, not {kind_name(item)}")
            elif item.value in models:
                fields.error(item, f"model '{item.value}' is listed twice")
            else:
                models.append(item.value)
        if not sequence.items:
            fields.error(sequence, "'models' must list at least one model (or '*')")
    if "*" in models:
        if len(models) > 1:
            fields.error(match, "'*' matches every model; list it alone")
        models = []
    headers_node = match_fields.mapping("headers")
    headers: tuple[tuple[str, str], ...] = ()
    if headers_node is not None:
        pairs = string_map(headers_node, fields.diagnostics, what="header")
        headers = tuple((name.lower(), value) for name, value in pairs)
    return tuple(models), headers, match


def _read_criticality(fields: Fields) -> tuple[str, str]:
    node = fields.mapping("criticality")
    if node is None:
        return DEFAULT_CRITICALITY_HEADER, "standard"
    reader = Fields(node, ("header", "default"), fields.diagnostics, what="'criticality'")
    header = DEFAULT_CRITICALITY_HEADER
    raw = reader.raw("header")
    if isinstance(raw, YScalar) and raw.value is None:
        header = ""  # `header: null`: clients cannot pick their criticality
    elif raw is not None:
        header_node = reader.string("header")
        header = str(header_node.value).lower() if header_node else header
    return header, reader.choice("default", CRITICALITIES, "standard")


def _read_models(fields: Fields) -> tuple[ModelSpec, ...]:
    node = fields.mapping("models")
    if node is None:
        return ()
    specs: list[ModelSpec] = []
    for name, (key, value) in node.entries.items():
        if not isinstance(value, YMapping):
            fields.error(value, f"model '{name}' must be a mapping, not {kind_name(value)}")
            continue
        reader = Fields(value, ("criticality", "targets"), fields.diagnostics, what="a model")
        criticality = reader.choice("criticality", CRITICALITIES, "") or None
        targets: list[tuple[str, int]] = []
        targets_node = reader.mapping("targets")
        if targets_node is not None:
            for target, (_, weight) in targets_node.entries.items():
                if not isinstance(weight, YScalar) or not is_int(weight.value):
                    fields.error(weight, f"the weight of '{target}' must be an integer")
                elif int(weight.value) < 0:  # type: ignore[arg-type]
                    fields.error(weight, f"the weight of '{target}' must not be negative")
                else:
                    targets.append((target, int(weight.value)))  # type: ignore[arg-type]
            if targets and not any(weight for _, weight in targets):
                fields.error(targets_node, "at least one target needs a weight above 0")
            if not targets_node.entries:
                fields.error(targets_node, "'targets' must name at least one model")
        specs.append(ModelSpec(name, key, criticality, tuple(targets)))
    return tuple(specs)


def _read_params(fields: Fields, broken: set[str]) -> tuple[ParamSpec, ...]:
    node = fields.mapping("params")
    if node is None:
        return ()
    specs: list[ParamSpec] = []
    for name, (key, value) in node.entries.items():
        if not IDENTIFIER.fullmatch(name):
            fields.error(key, f"param name '{name}' must be an identifier (letters, digits, _)")
            continue
        if not isinstance(value, YMapping):
            fields.error(value, f"param '{name}' must be a mapping like {{type: int, value: 5}}")
            broken.add(f"params.{name}")
            continue
        reader = Fields(value, ("type", "value", "description"), fields.diagnostics, what="a param")
        type_node = reader.string("type", required=True)
        value_node = reader.raw("value")
        if value_node is None:
            reader.error(value, f"param '{name}' has no 'value'")
        if type_node is None or value_node is None:
            broken.add(f"params.{name}")
            continue
        kind = str(type_node.value).replace(" ", "")
        if kind not in PARAM_TYPES:
            reader.error(
                type_node, f"unknown param type '{kind}'; use one of {', '.join(PARAM_TYPES)}"
            )
            broken.add(f"params.{name}")
            continue
        parsed = _param_value(kind, value_node)
        if isinstance(parsed, str):
            reader.error(value_node, f"param '{name}' is declared {kind} but {parsed}")
            specs.append(ParamSpec(name, key, kind, None, valid=False))
            continue
        specs.append(ParamSpec(name, key, kind, parsed[0]))
    return tuple(specs)


def _param_value(kind: str, node: YNode) -> tuple[object] | str:
    """``(value,)`` converted to the param's type, or why the value does not fit."""
    found = kind_name(node)
    if kind.startswith("list<"):
        if not isinstance(node, YSequence):
            return f"the value is {found}"
        items = [_param_value(kind[5:-1], item) for item in node.items]
        problems = [item for item in items if isinstance(item, str)]
        if problems:
            return f"an item is not a {kind[5:-1]}: {problems[0]}"
        return ([item[0] for item in items if not isinstance(item, str)],)
    if kind == "map<string,string>":
        if not isinstance(node, YMapping):
            return f"the value is {found}"
        values = [v for _, v in node.entries.values()]
        if not all(isinstance(v, YScalar) and isinstance(v.value, str) for v in values):
            return "a value is not a string"
        return (
            {key: str(v.value) for key, (_, v) in node.entries.items() if isinstance(v, YScalar)},
        )
    if not isinstance(node, YScalar):
        return f"the value is {found}"
    value = node.value
    if kind == "duration" and isinstance(value, str) and parse_duration(value) is None:
        return f"'{value}' is not a duration like 250ms, 1.5s or 1m30s"
    converted = scalar_value(kind, value)
    return f"the value is {found}" if converted is None else converted


def _read_variables(fields: Fields, broken: set[str]) -> tuple[VariableSpec, ...]:
    node = fields.mapping("variables")
    if node is None:
        return ()
    specs: list[VariableSpec] = []
    for name, (key, value) in node.entries.items():
        if not IDENTIFIER.fullmatch(name):
            fields.error(key, f"variable name '{name}' must be an identifier (letters, digits, _)")
            continue
        found = expression(fields, value, f"variable '{name}'")
        if found is None:
            broken.add(f"variables.{name}")
        else:
            specs.append(VariableSpec(name, key, found))
    return tuple(specs)


def _read_nodes(fields: Fields, broken: set[str]) -> tuple[NodeSpec, ...]:
    node = fields.mapping("filters")
    if node is None:
        return ()
    specs: list[NodeSpec] = []
    for name, (key, value) in node.entries.items():
        spec = None
        if isinstance(value, YMapping):
            spec = _read_node(fields.diagnostics, name, key, value)
        else:
            fields.error(value, f"node '{name}' must be a mapping, not {kind_name(value)}")
        if spec is None:
            broken.add(name)
        else:
            specs.append(spec)
    return tuple(specs)


def _read_node(
    diagnostics: list[Diagnostic], name: str, key: YScalar, node: YMapping
) -> NodeSpec | None:
    words = [word for word in node.entries if word in NODE_KINDS]
    if not words:
        listed = ", ".join(NODE_KINDS)
        diagnostics.append(key.source.diagnostic(key.at, f"node '{name}' needs one of: {listed}"))
        return None
    if len(words) > 1:
        second = node.entries[words[1]][0]
        diagnostics.append(
            key.source.diagnostic(
                second.at, f"node '{name}' has both '{words[0]}' and '{words[1]}'; use one"
            )
        )
        return None
    kind = NODE_KINDS[words[0]]
    fields = Fields(node, ("description", *kind.fields), diagnostics, what=f"node '{name}'")
    return kind.read(NodeSpec(name, key, kind, text(fields, "description")), fields)


def _read_scorers(fields: Fields) -> tuple[ScorerSpec, ...]:
    node = fields.mapping("score")
    if node is None:
        return ()
    specs: list[ScorerSpec] = []
    for name, (key, value) in node.entries.items():
        if not isinstance(value, YMapping):
            fields.error(value, f"scorer '{name}' must be a mapping like {{weight: 1, expr: ...}}")
            continue
        reader = Fields(
            value,
            ("weight", *SCORER_KINDS, "description"),
            fields.diagnostics,
            what="a scorer",
        )
        weight = reader.number("weight", default=1.0)
        if weight < 0:
            reader.error(
                reader.raw("weight") or value, f"the weight of scorer '{name}' must not be negative"
            )
        words = [word for word in SCORER_KINDS if reader.has(word)]
        if len(words) != 1:
            problem = (
                f"needs one of: {', '.join(SCORER_KINDS)}"
                if not words
                else f"has both '{words[0]}' and '{words[1]}'; use one"
            )
            reader.error(key, f"scorer '{name}' {problem}")
            continue
        word = words[0]
        found = expression(fields, value.entries[word][1], f"'{word}' of scorer '{name}'")
        if found is not None:
            specs.append(ScorerSpec(name, weight, SCORER_KINDS[word], found))
    return tuple(specs)
