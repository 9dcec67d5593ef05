"""From a policy spec to an immutable ``CompiledPolicy``, or every reason it cannot be.

The loader makes each decision it can so the hot path makes none: params are
folded into the CEL programs as constants, each expression knows the variables
it needs (dependencies first), node links are resolved to the node objects
themselves, and the picker is chosen. What it checks, each reported at the
offending place in the file:

- every CEL expression type-checks against the schema (a misspelt field, a
  type error, an undeclared param or variable; the CEL column lands in the file)
  and has the type its place requires (bool to keep, a number to rank);
  each node and scorer kind compiles its own (``policyd.policy.kinds``) through
  ``pod_expression`` / ``request_expression``;
- node links name existing nodes, and the filter tree has no cycle;
- nodes never reached from the first one, params and variables never used,
  and scores a picker would ignore are warnings.

It also works out which request fields the filter tree reads and whether it
reads anything that changes between two requests over the same pool snapshot
(``pod.in_flight``, headers, the request id): when it does not, the router can
reuse one walk of the tree for every request with the same key on one snapshot.
"""

from __future__ import annotations

import hashlib
import operator
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from policyd.cel import (
    DYN,
    POD_FIELDS,
    REQUEST_FIELDS,
    CelCompileError,
    DeclaredType,
    Environment,
    Program,
    cel_type_of,
    pod_type,
    request_type,
)
from policyd.fields import PREDICTION_POD_FIELDS, PREFIX_POD_FIELDS
from policyd.fields.roles import DECODE_CAPABLE, PREFILL_CAPABLE
from policyd.policy.diagnostics import Diagnostic, did_you_mean
from policyd.policy.document import PolicySpec, PrefillSpec
from policyd.policy.evaluation import BOOL, Evaluator, Needs, PodExpression
from policyd.policy.flow import CompiledFlow, compile_flow
from policyd.policy.kinds import PICKERS
from policyd.policy.nodes import Node, NodeSpec
from policyd.policy.pickers import Picker
from policyd.policy.reader import Expression
from policyd.policy.request import Request
from policyd.policy.scoring import Scorer, ScorerSpec
from policyd.policy.source import YNode

_UNDECLARED: Final = re.compile(r"undeclared reference to '([^']*)'")
_NO_FIELD: Final = re.compile(r"undefined field '([^']*)' not found in struct 'policyd\.(\w+)'")
# What a filter tree may read and still give the same walk for every request with
# the same key over one snapshot: not the pods' in-flight counts (they move with
# every request), nor what differs per request anyway (headers, the request id).
# Reads that make a policy need each request's prefix-cache match.
_PREFIX_READS: Final = frozenset({"pod.*", *(f"pod.{field.name}" for field in PREFIX_POD_FIELDS)})
# Reads that make a policy need each request's latency predictions.
_PREDICTION_READS: Final = frozenset(
    {"pod.*", *(f"pod.{field.name}" for field in PREDICTION_POD_FIELDS)}
)
# Reads that make a policy need each candidate's TPOT prediction, not the chosen pod's alone.
_TPOT_READS: Final = frozenset({"pod.*", "pod.predicted_tpot_ms"})
_NOT_CACHEABLE: Final = (
    _PREFIX_READS
    | _PREDICTION_READS
    | {
        "pod.in_flight",
        "pod.queued_prefill_tokens",
        "request.*",
        "request.headers",
        "request.id",
    }
)

WalkKey = Callable[[Request], Hashable]


@dataclass(frozen=True, slots=True)
class ModelRule:
    """What a policy does with one model name: criticality and traffic split."""

    criticality: str | None
    targets: tuple[str, ...] = ()
    cumulative_weights: tuple[int, ...] = ()

    def target_for(self, model: str, draw: Callable[[], float]) -> str:
        """The model to send the request to; ``draw()`` is uniform in [0, 1)."""
        if not self.targets:
            return model
        if len(self.targets) == 1:
            return self.targets[0]
        point = draw() * self.cumulative_weights[-1]
        for target, bound in zip(self.targets, self.cumulative_weights, strict=True):
            if point < bound:
                return target
        return self.targets[-1]


@dataclass(frozen=True, slots=True, eq=False)
class CompiledPrefill:
    """A policy's second stage: whether to split a request, and its prefill pod.

    ``when`` runs once per routed request, on the decode pod; the tree,
    scorers and picker choose among the prefill-capable pods of the policy's
    pool (``roles``) as the policy's own choose the decode pod, with a reusable
    walk keyed by ``walk_key``.
    """

    when: PodExpression
    description: str
    start: Node | None
    nodes: Mapping[str, Node]
    scorers: tuple[Scorer, ...]
    picker: Picker
    pool_labels: tuple[tuple[str, str], ...]
    walk_key: WalkKey | None
    roles: frozenset[str] | None = PREFILL_CAPABLE


@dataclass(frozen=True, slots=True, eq=False)
class CompiledPolicy:
    """One loaded policy, ready to decide; immutable except the round-robin turn."""

    name: str
    path: str
    version: str
    description: str
    name_at: tuple[int, int]  # where the name / match are written, for set-level errors
    match_at: tuple[int, int]
    models_matched: tuple[str, ...]  # empty: every model
    headers: tuple[tuple[str, str], ...]
    pool_labels: tuple[tuple[str, str], ...]
    criticality_header: str
    criticality_default: str
    models: Mapping[str, ModelRule]
    start: Node | None
    nodes: Mapping[str, Node]
    scorers: tuple[Scorer, ...]
    picker: Picker
    fallbacks: int
    warnings: tuple[Diagnostic, ...] = field(default=())
    # Shadow policies as written: (file relative to this one, (line, column) in this file).
    shadow_refs: tuple[tuple[str, tuple[int, int]], ...] = ()
    shadows_at: tuple[int, int] | None = None  # the `shadows` key
    # The loaded shadows (the loader fills them in): evaluated beside this policy
    # on the same request and candidates, never acted on.
    shadows: tuple[CompiledPolicy, ...] = ()
    # The request fields the filter tree reads, as one key (None: the walk
    # depends on more than the snapshot and those fields, so it is not reused).
    walk_key: WalkKey | None = None
    # Some expression reads the prefix fields: the router computes each
    # request's prefix-cache match for this policy, and for no other.
    reads_prefix: bool = False
    # Some expression reads the predicted latencies: the router asks the latency
    # models for this request on each candidate, for this policy and no other.
    reads_prediction: bool = False
    # Some expression reads ``pod.predicted_tpot_ms``: the router asks for each
    # candidate's TPOT, rather than the chosen pod's alone, for this policy.
    reads_tpot: bool = False
    # Flow control (None: a saturated pool is routed to, or shed, as the tree says).
    flow: CompiledFlow | None = None
    # Two stages (None: one): the tree above picks the decode pod among the
    # decode-capable pods (``roles``), this the prefill pod when it splits.
    prefill: CompiledPrefill | None = None
    roles: frozenset[str] | None = None  # the pod roles the tree chooses among (None: any)

    @property
    def summary(self) -> str:
        """One line for ``policyd check``."""
        models = ", ".join(self.models_matched) or "*"
        parts = [
            f"policy '{self.name}' (version {self.version})",
            f"models {models}",
            _count(len(self.nodes), "filter node"),
            _count(len(self.scorers), "scorer"),
            f"pick {self.picker.name}"
            + (f" + {_count(self.fallbacks, 'fallback')}" if self.fallbacks else ""),
        ]
        if self.flow is not None:
            parts.append(f"flow control over {_count(len(self.flow.bands), 'band')}")
        if self.prefill is not None:
            prefill = self.prefill
            parts.append(
                f"prefill stage of {_count(len(prefill.nodes), 'filter node')},"
                f" {_count(len(prefill.scorers), 'scorer')}, pick {prefill.picker.name}"
            )
        if self.shadows:
            listed = ", ".join(f"'{s.name}' (version {s.version})" for s in self.shadows)
            parts.append(f"shadows {listed}")
        return ", ".join(parts)


def _count(number: int, thing: str) -> str:
    return f"{number} {thing}" + ("" if number == 1 else "s")


def content_version(text: str) -> str:
    """A policy's version: the start of the SHA-256 of its source."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def compile_policy(
    spec: PolicySpec, *, shape_errors: bool = False
) -> tuple[CompiledPolicy | None, list[Diagnostic]]:
    """The compiled policy (None if there is any error) and every diagnostic.

    ``shape_errors`` says the file already had errors when it was read: the
    compiler still reports what it finds, but not warnings that the missing
    parts could make wrong (an "unused" param used by a broken node).
    """
    return _Compiler(spec, shape_errors).run()


class _Compiler:
    def __init__(self, spec: PolicySpec, shape_errors: bool) -> None:
        self.spec = spec
        self.shape_errors = shape_errors
        self.source = spec.source
        self.diagnostics: list[Diagnostic] = []
        self.referenced: set[str] = set()
        self.param_types: dict[str, DeclaredType] = {
            f"params.{p.name}": cel_type_of(p.type) for p in spec.params
        }
        self.constants: dict[str, Any] = {
            f"params.{p.name}": p.value for p in spec.params if p.valid
        }
        self.variable_types: dict[str, DeclaredType] = {}
        self.variable_needs: dict[str, Needs] = {}
        self.variable_reads: dict[str, frozenset[str]] = {}  # with their dependencies'
        # Fields of pod / request that the expressions compiled since it was last
        # emptied read: the filter tree's, once it is compiled (for ``walk_key``).
        self.reads: set[str] = set()
        self.every_read: set[str] = set()  # never emptied: scorers, variables and tree
        self.pod_env = self.request_env = Environment({})

    def error(self, node: YNode, message: str) -> None:
        self.diagnostics.append(self.source.diagnostic(node.at, message))

    def warning(self, node: YNode, message: str) -> None:
        self.diagnostics.append(self.source.diagnostic(node.at, message, warning=True))

    def run(self) -> tuple[CompiledPolicy | None, list[Diagnostic]]:
        spec = self.spec
        self._compile_variables()
        self.pod_env = Environment(
            {
                "pod": pod_type(),
                "request": request_type(),
                **self.param_types,
                **self.variable_types,
            }
        )
        self.request_env = Environment({"request": request_type(), **self.param_types})
        scorers = self._compile_scorers(spec.scorers)
        self.reads.clear()
        nodes = self._compile_tree(spec.nodes, spec.broken)
        walk_key = _walk_key(self.reads)  # the tree's reads, before the flow's
        flow = compile_flow(spec.flow, self, self.error) if spec.flow is not None else None
        prefill = self._compile_prefill(spec.prefill) if spec.prefill is not None else None
        self._check_models()
        picker = PICKERS[spec.pick_strategy]()
        self._check_pick(picker, spec.pick_node, spec.scorers, spec.nodes)
        if self.shape_errors or any(d.severity == "error" for d in self.diagnostics):
            return None, self.diagnostics  # what is "unused" is not known when some failed
        self._warn_unused()
        policy = CompiledPolicy(
            name=spec.name,
            path=self.source.path,
            version=content_version(self.source.text),
            description=spec.description,
            name_at=spec.name_at,
            match_at=spec.match_node.at if spec.match_node is not None else (1, 1),
            models_matched=spec.models_matched,
            headers=spec.headers,
            pool_labels=spec.pool_labels,
            criticality_header=spec.criticality_header,
            criticality_default=spec.criticality_default,
            models=MappingProxyType(
                {m.name: _model_rule(m.criticality, m.targets) for m in spec.models}
            ),
            start=nodes[spec.nodes[0].name] if spec.nodes else None,
            nodes=MappingProxyType(nodes),
            scorers=scorers,
            picker=picker,
            fallbacks=spec.fallbacks,
            warnings=tuple(sorted(self.diagnostics)),
            shadow_refs=tuple((ref.file, ref.node.at) for ref in spec.shadows),
            shadows_at=spec.shadows_node.at if spec.shadows_node is not None else None,
            walk_key=walk_key,
            reads_prefix=bool(self.every_read & _PREFIX_READS),
            reads_prediction=bool(self.every_read & _PREDICTION_READS),
            reads_tpot=bool(self.every_read & _TPOT_READS),
            flow=flow,
            prefill=prefill,
            roles=DECODE_CAPABLE if spec.prefill is not None else None,
        )
        return policy, self.diagnostics

    def _compile_prefill(self, spec: PrefillSpec) -> CompiledPrefill | None:
        """The second stage; None when some part of it did not compile (reported)."""
        when = None
        if spec.when is not None:
            when = self.pod_expression(spec.when, what="'when' of 'prefill'", want=BOOL)
        scorers = self._compile_scorers(spec.scorers)
        self.reads.clear()
        nodes = self._compile_tree(spec.nodes, spec.broken)
        walk_key = _walk_key(self.reads)
        picker = PICKERS[spec.pick_strategy]()
        self._check_pick(picker, spec.pick_node or spec.key, spec.scorers, spec.nodes)
        if when is None:
            return None
        return CompiledPrefill(
            when=when,
            description=spec.description,
            start=nodes[spec.nodes[0].name] if spec.nodes and spec.nodes[0].name in nodes else None,
            nodes=MappingProxyType(nodes),
            scorers=scorers,
            picker=picker,
            pool_labels=self.spec.pool_labels,
            walk_key=walk_key,
        )

    # --- CEL -------------------------------------------------------------------------

    def _compile(
        self,
        env: Environment,
        expression: Expression,
        *,
        what: str,
        want: tuple[str, ...],
        sees: str = "",
    ) -> tuple[Program, frozenset[str], DeclaredType] | None:
        """Check and compile one expression; report errors at their place in the file.

        ``sees`` says why a pod is out of reach, for expressions compiled in the
        request-only environment.
        """
        try:
            program = env.compile(expression.source, constants=self.constants)
        except CelCompileError as error:
            at = expression.locate(error.line, error.column)
            explained = self._explain(error.message, env, sees)
            self.diagnostics.append(self.source.diagnostic(at, explained))
            return None
        names = program.reads
        self.referenced |= names
        self.reads |= self._reads(names)
        self.every_read |= self.reads
        if want and program.return_type not in want:
            expected = " or ".join(w.lower() for w in want)
            self.error(
                expression.node,
                f"{what} must be {expected}, but this expression is {program.return_type.lower()}",
            )
            return None
        return program, names, program.value_type

    def _explain(self, message: str, env: Environment, sees: str) -> str:
        """The checker's message, plus what the policy author most likely meant."""
        message = message.replace(" (in container '')", "")
        if match := _NO_FIELD.search(message):
            fields = POD_FIELDS if match.group(2) == "Pod" else REQUEST_FIELDS
            return message + did_you_mean(match.group(1), (f.name for f in fields))
        match = _UNDECLARED.search(message)
        if match is None:
            return message
        name = match.group(1)
        declared = env.variables
        if (name == "pod" or name.startswith(("pod.", "variables."))) and "pod" not in declared:
            return f"{message}: {sees}"
        if name.startswith("params."):
            params = [n.removeprefix("params.") for n in self.param_types]
            known = f"declared params: {', '.join(params)}" if params else "no params are declared"
            hint = did_you_mean(name.removeprefix("params."), params)
            return f"{message}{hint} ({known})"
        if name.startswith("variables."):
            short = name.removeprefix("variables.")
            if short in {v.name for v in self.spec.variables} and name not in declared:
                return f"{message}: a variable can use only the variables declared above it"
            return message + did_you_mean(short, [v.name for v in self.spec.variables])
        return message

    def _compile_variables(self) -> None:
        for variable in self.spec.variables:
            env = Environment(
                {
                    "pod": pod_type(),
                    "request": request_type(),
                    **self.param_types,
                    **self.variable_types,
                }
            )
            full_name = f"variables.{variable.name}"
            compiled = self._compile(
                env, variable.expression, what=f"variable '{variable.name}'", want=()
            )
            if compiled is None:
                self.variable_types[full_name] = DYN  # checked on, reported once
                self.variable_needs[full_name] = ()
                continue
            program, names, return_type = compiled
            self.variable_types[full_name] = return_type
            self.variable_reads[full_name] = self._reads(names)
            self.variable_needs[full_name] = (
                *self._needs(names),
                (full_name, program.evaluate),
            )

    def _needs(self, names: frozenset[str]) -> Needs:
        """Variables behind ``names``, transitively, in declaration order, each once."""
        needs: dict[str, Evaluator] = {}
        for name in self.variable_needs:  # declaration order
            if name in names:
                for dependency, evaluate in self.variable_needs[name]:
                    needs.setdefault(dependency, evaluate)
        return tuple(needs.items())

    def _reads(self, names: frozenset[str]) -> frozenset[str]:
        """The pod and request fields behind ``names``, through the variables used."""
        reads = {name for name in names if name.startswith(("pod.", "request."))}
        for name in names & self.variable_reads.keys():
            reads |= self.variable_reads[name]
        return frozenset(reads)

    def pod_expression(
        self, expression: Expression, *, what: str, want: tuple[str, ...]
    ) -> PodExpression | None:
        compiled = self._compile(self.pod_env, expression, what=what, want=want)
        if compiled is None:
            return None
        return PodExpression(expression.source, compiled[0].evaluate, self._needs(compiled[1]))

    def request_expression(
        self, expression: Expression, *, what: str, want: tuple[str, ...], sees: str
    ) -> Evaluator | None:
        compiled = self._compile(self.request_env, expression, what=what, want=want, sees=sees)
        return compiled[0].evaluate if compiled is not None else None

    def _compile_scorers(self, specs: Sequence[ScorerSpec]) -> tuple[Scorer, ...]:
        scorers: list[Scorer] = []
        for spec in specs:
            values = spec.kind.build(spec, self)
            if values is not None:
                scorers.append(Scorer(spec.name, spec.weight, values))
        return tuple(scorers)

    # --- the filter tree ---------------------------------------------------------------

    def _compile_tree(
        self, node_specs: Sequence[NodeSpec], broken: frozenset[str]
    ) -> dict[str, Node]:
        """One filter tree (the policy's, or its prefill stage's), its first node first."""
        specs = {node.name: node for node in node_specs}
        for spec in node_specs:
            for link in spec.links:
                if link.name not in specs and link.name not in broken:
                    hint = did_you_mean(link.name, specs)
                    self.error(link.node, f"unknown node '{link.name}' in '{link.field}'{hint}")
        order = self._check_cycles(specs)
        if node_specs:
            reached = _reachable(node_specs[0].name, specs)
            start = node_specs[0].name
            for spec in node_specs:
                if spec.name not in reached:
                    self.warning(spec.key, f"node '{spec.name}' is never reached from '{start}'")
        built: dict[str, Node] = {}
        for name in order:  # leaves first, so links resolve to built nodes
            spec = specs[name]
            success = built.get(spec.on_success.name) if spec.on_success else None
            failure = built.get(spec.on_failure.name) if spec.on_failure else None
            node = spec.kind.build(spec, self, success, failure)
            if node is not None:
                built[name] = node
        return {spec.name: built[spec.name] for spec in node_specs if spec.name in built}

    def _check_cycles(self, specs: Mapping[str, NodeSpec]) -> list[str]:
        """Report each cycle once; return the node names leaves first."""
        done: set[str] = set()
        order: list[str] = []
        path: list[str] = []

        def visit(name: str) -> None:
            path.append(name)
            for link in specs[name].links:
                if link.name not in specs or link.name in done:
                    continue
                if link.name in path:
                    loop = [*path[path.index(link.name) :], link.name]
                    self.error(link.node, f"cycle in the filter tree: {' -> '.join(loop)}")
                    continue
                visit(link.name)
            path.pop()
            if name not in done:
                done.add(name)
                order.append(name)

        for name in specs:
            if name not in done:
                visit(name)
        return order

    # --- the rest ------------------------------------------------------------------------

    def _check_models(self) -> None:
        matched = self.spec.models_matched
        for model in self.spec.models:
            if matched and model.name not in matched:
                self.error(
                    model.key,
                    f"model '{model.name}' has settings but 'match.models' does not list it",
                )

    def _check_pick(
        self,
        picker: Picker,
        node: YNode | None,
        scorers: Sequence[ScorerSpec],
        nodes: Sequence[NodeSpec],
    ) -> None:
        at = node if node is not None else nodes[0].key if nodes else None
        if picker.uses_scores and not scorers and at is not None:
            self.warning(at, f"pick '{picker.name}' without scorers picks at random")
        if not picker.uses_scores and scorers and at is not None:
            self.warning(at, f"pick '{picker.name}' ignores the scores; they are not computed")

    def _warn_unused(self) -> None:
        for param in self.spec.params:
            if f"params.{param.name}" not in self.referenced:
                self.warning(param.key, f"param '{param.name}' is never used")
        for variable in self.spec.variables:
            if f"variables.{variable.name}" not in self.referenced:
                self.warning(variable.key, f"variable '{variable.name}' is never used")


def _reachable(start: str, specs: Mapping[str, NodeSpec]) -> set[str]:
    seen = {start}
    stack = [start]
    while stack:
        for link in specs[stack.pop()].links:
            if link.name in specs and link.name not in seen:
                seen.add(link.name)
                stack.append(link.name)
    return seen


def _walk_key(reads: set[str]) -> WalkKey | None:
    """The key of a reusable walk: the request fields the tree reads, or None."""
    if reads & _NOT_CACHEABLE:
        return None
    fields = sorted(name.removeprefix("request.") for name in reads if name.startswith("request."))
    if not fields:
        return _no_key
    return operator.attrgetter(*fields)


def _no_key(request: Request) -> None:
    """A tree that reads no request field walks the same way for every request."""
    return None


def _model_rule(criticality: str | None, targets: tuple[tuple[str, int], ...]) -> ModelRule:
    kept = [(target, weight) for target, weight in targets if weight > 0]
    cumulative: list[int] = []
    running = 0
    for _, weight in kept:
        running += weight
        cumulative.append(running)
    return ModelRule(criticality, tuple(t for t, _ in kept), tuple(cumulative))
