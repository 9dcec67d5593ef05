"""``keep: <bool CEL>``: the pods for which the predicate is true."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from policyd.policy.evaluation import BOOL, Evaluation
from policyd.policy.nodes import LINKS, Filtering, Visit, links_schema
from policyd.policy.pods import PolicyPod


@dataclass(frozen=True, slots=True, eq=False)
class KeepNode(Filtering):
    """Keeps the pods for which the expression is ``true``."""

    kind: ClassVar[str] = "keep"
    want: ClassVar[tuple[str, ...]] = BOOL
    fields: ClassVar[tuple[str, ...]] = ("keep", "on_error", *LINKS)
    schema: ClassVar[dict[str, Any]] = links_schema(
        {"keep": {"$ref": "#/$defs/cel"}},
        "keep",
        "keep: the pods for which a bool CEL expression is true",
    )

    def visit(self, pods: Sequence[PolicyPod], ev: Evaluation) -> Visit:
        kept, errors = self.expression.select(pods, ev, keep_failed=self.keep_failed)
        return self._continue(pods, kept, errors)
