"""``strategy: max-score``: the highest total wins."""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class MaxScore:
    """The highest total wins; a tie is broken at random; fallbacks by score."""

    name: ClassVar[str] = "max-score"
    uses_scores: ClassVar[bool] = True

    def pick(
        self, totals: Sequence[float] | None, count: int, fallbacks: int, rng: random.Random
    ) -> list[int]:
        assert totals is not None
        best = max(totals)
        tied = [i for i, total in enumerate(totals) if total == best]
        chosen = tied[rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
        if not fallbacks:
            return [chosen]
        rest = (i for i in range(count) if i != chosen)
        return [chosen, *heapq.nlargest(fallbacks, rest, key=totals.__getitem__)]
