"""``band: <number CEL>``: the pods within ``[min, min + (max - min) / N]``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from policyd.policy.evaluation import FAILED, NUMBERS, Evaluation
from policyd.policy.nodes import LINKS, Filtering, Visit, links_schema
from policyd.policy.pods import PolicyPod


@dataclass(frozen=True, slots=True, eq=False)
class BandNode(Filtering):
    """The pods whose value is within ``[min, min + (max - min) / N]``.

    N is the number of pods entering the node, as in the original "least
    queuing" and "least KV cache" filters. For an int value the test
    ``value <= min + (max - min) / N`` equals the original's integer division,
    because an integer is at most x exactly when it is at most floor(x).
    Pods whose value failed are left out of min and max.
    """

    kind: ClassVar[str] = "band"
    want: ClassVar[tuple[str, ...]] = NUMBERS
    fields: ClassVar[tuple[str, ...]] = ("band", "on_error", *LINKS)
    schema: ClassVar[dict[str, Any]] = links_schema(
        {"band": {"$ref": "#/$defs/cel"}},
        "band",
        "band: the pods whose value is within [min, min + (max - min) / N]",
    )

    def visit(self, pods: Sequence[PolicyPod], ev: Evaluation) -> Visit:
        values, errors = self.expression.values(pods, ev)
        numbers = [v for v in values if v is not FAILED] if errors else values
        if not numbers:
            kept = list(pods) if self.keep_failed else []
            return self._continue(pods, kept, errors)
        low = min(numbers)
        limit = low + (max(numbers) - low) / len(pods)
        if errors:
            keep_failed = self.keep_failed
            kept = [
                pod
                for pod, value in zip(pods, values, strict=True)
                if (value is FAILED and keep_failed) or (value is not FAILED and value <= limit)
            ]
        else:
            kept = [pod for pod, value in zip(pods, values, strict=True) if value <= limit]
        return self._continue(pods, kept, errors, (low, limit))
