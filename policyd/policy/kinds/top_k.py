"""``top_k: K`` with ``lowest:`` or ``highest:``: the K pods with the extreme values."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from policyd.policy.evaluation import FAILED, NUMBERS, Evaluation
from policyd.policy.nodes import LINKS, Filtering, NodeSpec, Visit, links_schema
from policyd.policy.pods import PolicyPod
from policyd.policy.reader import Fields, expression


@dataclass(frozen=True, slots=True, eq=False)
class TopKNode(Filtering):
    """The K pods with the lowest (or highest) value.

    Ties at the cut go to the pod that comes first among the candidates; the
    kept pods stay in candidate order.
    """

    k: int
    highest: bool

    kind: ClassVar[str] = "top_k"
    want: ClassVar[tuple[str, ...]] = NUMBERS
    fields: ClassVar[tuple[str, ...]] = ("top_k", "lowest", "highest", "on_error", *LINKS)
    schema: ClassVar[dict[str, Any]] = {
        **links_schema(
            {
                "top_k": {"type": "integer", "minimum": 1},
                "lowest": {"$ref": "#/$defs/cel"},
                "highest": {"$ref": "#/$defs/cel"},
            },
            "top_k",
            "top_k: the K pods with the lowest or highest value",
        ),
        "oneOf": [{"required": ["lowest"]}, {"required": ["highest"]}],
    }

    @classmethod
    def read(cls, spec: NodeSpec, fields: Fields) -> NodeSpec | None:
        k = fields.integer("top_k", minimum=1, default=1) or 1
        ends = [end for end in ("lowest", "highest") if fields.has(end)]
        if len(ends) != 1:
            fields.error(
                fields.node.entries["top_k"][0],
                f"node '{spec.name}' needs exactly one of 'lowest' or 'highest'",
            )
            return cls.read_links(spec, fields, None)  # None, its mistakes reported too
        end = ends[0]
        found = expression(fields, fields.node.entries[end][1], f"'{end}' of node '{spec.name}'")
        return cls.read_links(spec, fields, found, k=k, highest=end == "highest")

    def visit(self, pods: Sequence[PolicyPod], ev: Evaluation) -> Visit:
        values, errors = self.expression.values(pods, ev)
        ranked = [i for i, value in enumerate(values) if value is not FAILED]
        if len(ranked) > self.k:
            choose = heapq.nlargest if self.highest else heapq.nsmallest
            ranked = sorted(choose(self.k, ranked, key=values.__getitem__))
        if errors and self.keep_failed:
            ranked = sorted({*ranked, *(i for i, v in enumerate(values) if v is FAILED)})
        kept = [pods[i] for i in ranked]
        return self._continue(pods, kept, errors)
