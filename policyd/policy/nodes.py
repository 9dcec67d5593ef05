"""What a filter-tree node kind is. Each kind is one class in ``policyd.policy.kinds``.

A kind's class says everything about the kind: the YAML word that makes a
node of it (also its name in traces, metrics and ``explain``), the fields it
accepts and their JSON Schema, how it is read (``read``) and compiled
(``build``), and what its node does on each walk (``visit``) and shows in
``explain``. The trace a node makes (``NodeTrace``) carries what the metrics
and the demo need to know about it (``narrows``).

The walk semantics are those of the Gateway API Inference Extension's original
scheduler: a filtering node *succeeds* when it keeps at least one pod; on
success the kept pods go on to ``on_success``, on failure the node's *input*
goes on to ``on_failure``; a node with nowhere to go ends the walk with its
own result (so a failing node without ``on_failure`` ends it with no pods).

Nodes are built leaves first (the tree is acyclic, the compiler checks), so a
node holds its successors directly and the whole tree is immutable.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, Self

from policyd.policy.decision import NodeTrace
from policyd.policy.evaluation import Compiling, Evaluation, PodExpression
from policyd.policy.pods import PolicyPod
from policyd.policy.reader import Expression, Fields, Reference, expression, reference
from policyd.policy.source import YScalar

_pod_name = operator.attrgetter("name")
LINKS = ("next", "on_success", "on_failure")


def pod_names(pods: Sequence[PolicyPod]) -> tuple[str, ...]:
    return tuple(map(_pod_name, pods))


# What one node did: its trace, the pods handed on, the next node (None: the walk
# ends), and a shed reason (non-empty: stop and answer 429). A plain tuple, as it
# is built once per node and decision.
Visit = tuple[NodeTrace, Sequence[PolicyPod], "Node | None", str]


@dataclass(frozen=True, slots=True, eq=False)
class NodeSpec:
    """One filter-tree node as read from the file; ``links`` name the nodes that may follow.

    ``settings`` is what the kind read besides its expression and links, passed
    to its class by keyword when the node is built.
    """

    name: str
    key: YScalar
    kind: NodeKind
    description: str
    expression: Expression | None = None
    on_success: Reference | None = None  # "then" for an `if`
    on_failure: Reference | None = None  # "else" for an `if`
    settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def links(self) -> tuple[Reference, ...]:
        if self.on_success is self.on_failure:  # `next`: one link for both
            return (self.on_success,) if self.on_success is not None else ()
        return tuple(link for link in (self.on_success, self.on_failure) if link is not None)


class Node(Protocol):
    """A compiled node, as the router walks it and ``explain`` shows it."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def description(self) -> str: ...

    def visit(self, pods: Sequence[PolicyPod], ev: Evaluation) -> Visit: ...

    def explain(self, pods: Sequence[PolicyPod], ev: Evaluation) -> tuple[str, list[Any]]:
        """The expression as written, and its value on each pod (empty: not per pod)."""
        ...


class NodeKind(Protocol):
    """One node kind: its class, as ``policyd.policy.kinds`` registers it."""

    @property
    def kind(self) -> str:
        """The YAML word that makes a node this kind; its kind in traces, metrics, explain."""
        ...

    @property
    def fields(self) -> tuple[str, ...]:
        """What else a node of this kind accepts (``description`` goes without saying)."""
        ...

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON Schema of such a node, for ``policy.schema.json``."""
        ...

    def read(self, spec: NodeSpec, fields: Fields) -> NodeSpec | None:
        """``spec`` (name, description) completed from the node's ``fields``, or None."""
        ...

    def build(
        self,
        spec: NodeSpec,
        compiler: Compiling,
        on_success: Node | None,
        on_failure: Node | None,
    ) -> Node | None:
        """The node, or None when an expression did not compile (reported)."""
        ...


def links_schema(properties: dict[str, Any], required: str, title: str) -> dict[str, Any]:
    """The JSON Schema of a filtering node: its own ``properties`` plus on_error and links."""
    return {
        "title": title,
        "type": "object",
        "additionalProperties": False,
        "required": [required],
        "properties": {
            "description": {"type": "string"},
            **properties,
            "on_error": {"$ref": "#/$defs/onError"},
            **{link: {"$ref": "#/$defs/nodeName"} for link in LINKS},
        },
        "not": {
            "required": ["next"],
            "anyOf": [{"required": ["on_success"]}, {"required": ["on_failure"]}],
        },
    }


@dataclass(frozen=True, slots=True, eq=False)
class Filtering:
    """What the filtering kinds (keep, band, top_k) share: one per-pod expression,
    ``on_error``, and ``next`` or ``on_success`` / ``on_failure``."""

    name: str
    description: str
    expression: PodExpression
    keep_failed: bool  # on_error: pass
    on_success: Node | None
    on_failure: Node | None

    kind: ClassVar[str]
    want: ClassVar[tuple[str, ...]]  # the CEL types the expression may have
    fields: ClassVar[tuple[str, ...]]

    @classmethod
    def read(cls, spec: NodeSpec, fields: Fields) -> NodeSpec | None:
        node = fields.node.entries[cls.kind][1]
        found = expression(fields, node, f"'{cls.kind}' of node '{spec.name}'")
        return cls.read_links(spec, fields, found)

    @classmethod
    def read_links(
        cls, spec: NodeSpec, fields: Fields, found: Expression | None, **settings: Any
    ) -> NodeSpec | None:
        """``spec`` with the expression, on_error and links; None without an expression."""
        keep_failed = fields.choice("on_error", ("drop", "pass"), "drop") == "pass"
        following = reference(fields, "next")
        on_success = reference(fields, "on_success")
        on_failure = reference(fields, "on_failure")
        if following is not None:
            if on_success is not None or on_failure is not None:
                fields.error(
                    following.node,
                    f"node '{spec.name}' has 'next' and 'on_success'/'on_failure'; "
                    "'next' already covers both",
                )
            on_success = on_failure = following
        if found is None:
            return None
        return dataclasses.replace(
            spec,
            expression=found,
            on_success=on_success,
            on_failure=on_failure,
            settings=MappingProxyType({"keep_failed": keep_failed, **settings}),
        )

    @classmethod
    def build(
        cls,
        spec: NodeSpec,
        compiler: Compiling,
        on_success: Node | None,
        on_failure: Node | None,
    ) -> Self | None:
        assert spec.expression is not None
        compiled = compiler.pod_expression(
            spec.expression, what=f"node '{spec.name}'", want=cls.want
        )
        if compiled is None:
            return None
        return cls(
            name=spec.name,
            description=spec.description,
            expression=compiled,
            on_success=on_success,
            on_failure=on_failure,
            **spec.settings,
        )

    def explain(self, pods: Sequence[PolicyPod], ev: Evaluation) -> tuple[str, list[Any]]:
        return self.expression.source, self.expression.values(pods, ev)[0]

    def _continue(
        self,
        pods: Sequence[PolicyPod],
        kept: list[PolicyPod],
        errors: list[tuple[str, str]],
        band: tuple[float, float] | None = None,
    ) -> Visit:
        forward: Sequence[PolicyPod] = kept
        if kept:
            following, branch = self.on_success, "on_success"
        else:
            following, branch = self.on_failure, "on_failure"
            if following is not None:
                forward = pods
        trace = NodeTrace(
            self.name,
            self.kind,
            len(pods),
            pod_names(kept),
            tuple(errors),
            branch,
            following.name if following is not None else "",
            "",
            band,
            True,
        )
        return trace, forward, following, ""
