"""``expr: <number or bool CEL over the pod>``: the pod's score, per pod."""

from __future__ import annotations

from typing import Any, ClassVar

from policyd.policy.evaluation import BOOL, NUMBERS, Compiling, PodExpression
from policyd.policy.scoring import ScorerSpec


class ExprScorer:
    """The expression's value on each pod (a bool counts as 0 or 1).

    The kind only compiles: what it computes is the ``PodExpression`` itself.
    """

    kind: ClassVar[str] = "expr"
    schema: ClassVar[dict[str, Any]] = {
        "$ref": "#/$defs/cel",
        "description": "The pod's score: a number or bool over pod, request, params and variables.",
    }

    @classmethod
    def build(cls, spec: ScorerSpec, compiler: Compiling) -> PodExpression | None:
        return compiler.pod_expression(
            spec.expression, what=f"scorer '{spec.name}'", want=(*NUMBERS, *BOOL)
        )
