"""``shed: <reason>``: stop; the request is answered 429 with the reason."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from policyd.policy.decision import NodeTrace
from policyd.policy.evaluation import Compiling, Evaluation
from policyd.policy.nodes import Node, NodeSpec, Visit
from policyd.policy.pods import PolicyPod
from policyd.policy.reader import Fields


@dataclass(frozen=True, slots=True, eq=False)
class ShedNode:
    """Ends the walk: the request is answered 429 with the reason. No links."""

    name: str
    description: str
    reason: str

    kind: ClassVar[str] = "shed"
    fields: ClassVar[tuple[str, ...]] = ("shed",)
    schema: ClassVar[dict[str, Any]] = {
        "title": "shed: stop and answer 429 with this reason",
        "type": "object",
        "additionalProperties": False,
        "required": ["shed"],
        "properties": {
            "description": {"type": "string"},
            "shed": {"type": "string", "minLength": 1},
        },
    }

    @classmethod
    def read(cls, spec: NodeSpec, fields: Fields) -> NodeSpec | None:
        reason = fields.string("shed")
        return dataclasses.replace(
            spec, settings={"reason": str(reason.value) if reason else "shed"}
        )

    @classmethod
    def build(
        cls,
        spec: NodeSpec,
        compiler: Compiling,
        on_success: Node | None,
        on_failure: Node | None,
    ) -> ShedNode:
        return cls(spec.name, spec.description, **spec.settings)

    def visit(self, pods: Sequence[PolicyPod], ev: Evaluation) -> Visit:
        trace = NodeTrace(self.name, self.kind, len(pods), (), note=self.reason)
        return trace, (), None, self.reason

    def explain(self, pods: Sequence[PolicyPod], ev: Evaluation) -> tuple[str, list[Any]]:
        return "", []
