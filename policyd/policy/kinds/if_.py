"""``if: <bool CEL over request>``: choose a branch; every pod goes on."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from policyd.cel import CelEvalError
from policyd.policy.decision import NodeTrace
from policyd.policy.evaluation import BOOL, Compiling, Evaluation, Evaluator
from policyd.policy.nodes import Node, NodeSpec, Visit
from policyd.policy.pods import PolicyPod
from policyd.policy.reader import Fields, expression, reference

SEES: Final = (
    "an 'if' condition runs once per request and sees only request and params "
    "(use 'keep' to test pods)"
)


@dataclass(frozen=True, slots=True, eq=False)
class IfNode:
    """Runs once per request: ``then`` when true, ``else`` when false.

    An error takes the ``else`` branch and is traced. Its trace leaves ``kept``
    empty: every pod goes on (``candidates_in`` of them).
    """

    name: str
    description: str
    source: str
    evaluate: Evaluator
    then: Node | None
    otherwise: Node | None

    kind: ClassVar[str] = "if"
    fields: ClassVar[tuple[str, ...]] = ("if", "then", "else")
    schema: ClassVar[dict[str, Any]] = {
        "title": "if: branch on a bool CEL expression over request and params",
        "type": "object",
        "additionalProperties": False,
        "required": ["if"],
        "properties": {
            "description": {"type": "string"},
            "if": {"$ref": "#/$defs/cel"},
            "then": {"$ref": "#/$defs/nodeName"},
            "else": {"$ref": "#/$defs/nodeName"},
        },
    }

    @classmethod
    def read(cls, spec: NodeSpec, fields: Fields) -> NodeSpec | None:
        found = expression(fields, fields.node.entries["if"][1], f"'if' of node '{spec.name}'")
        then, otherwise = reference(fields, "then"), reference(fields, "else")
        if found is None:
            return None
        return dataclasses.replace(spec, expression=found, on_success=then, on_failure=otherwise)

    @classmethod
    def build(
        cls,
        spec: NodeSpec,
        compiler: Compiling,
        on_success: Node | None,
        on_failure: Node | None,
    ) -> IfNode | None:
        assert spec.expression is not None
        evaluate = compiler.request_expression(
            spec.expression, what=f"node '{spec.name}'", want=BOOL, sees=SEES
        )
        if evaluate is None:
            return None
        return cls(
            spec.name, spec.description, spec.expression.source, evaluate, on_success, on_failure
        )

    def visit(self, pods: Sequence[PolicyPod], ev: Evaluation) -> Visit:
        errors: tuple[tuple[str, str], ...] = ()
        try:
            result = self.evaluate(ev.activation) is True
        except CelEvalError as error:
            result, errors = False, (("", str(error)),)
        following, branch = (self.then, "then") if result else (self.otherwise, "else")
        trace = NodeTrace(
            self.name,
            self.kind,
            len(pods),
            (),
            errors,
            branch,
            following.name if following is not None else "",
            "error" if errors else str(result).lower(),
        )
        return trace, pods, following, ""

    def explain(self, pods: Sequence[PolicyPod], ev: Evaluation) -> tuple[str, list[Any]]:
        return self.source, []
