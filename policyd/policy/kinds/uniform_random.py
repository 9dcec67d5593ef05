"""``strategy: random``: every survivor equally likely."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class UniformRandom:
    """Every survivor equally likely (the seed scheduler's final pick)."""

    name: ClassVar[str] = "random"
    uses_scores: ClassVar[bool] = False

    def pick(
        self, totals: Sequence[float] | None, count: int, fallbacks: int, rng: random.Random
    ) -> list[int]:
        if not fallbacks:
            return [rng.randrange(count)]
        return rng.sample(range(count), min(count, 1 + fallbacks))
