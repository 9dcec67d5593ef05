"""``strategy: weighted-random``: a pod's chance is its share of the total score."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class WeightedRandom:
    """A pod's chance is its share of the total score (uniform if all are 0).

    Fallbacks are drawn the same way from the pods not yet chosen.
    """

    name: ClassVar[str] = "weighted-random"
    uses_scores: ClassVar[bool] = True

    def pick(
        self, totals: Sequence[float] | None, count: int, fallbacks: int, rng: random.Random
    ) -> list[int]:
        assert totals is not None
        remaining = list(range(count))
        chosen: list[int] = []
        for _ in range(min(count, 1 + fallbacks)):
            weights = [totals[i] for i in remaining]
            total = sum(weights)
            if total > 0:
                position = _weighted_index(weights, rng.random() * total)
            else:
                position = rng.randrange(len(remaining))
            chosen.append(remaining.pop(position))
        return chosen


def _weighted_index(weights: Sequence[float], target: float) -> int:
    running = 0.0
    last = 0
    for index, weight in enumerate(weights):
        if weight > 0:
            running += weight
            last = index
            if target < running:
                return index
    return last  # rounding left target at the very end
