"""``strategy: round-robin``: each decision takes the next survivor in turn."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class RoundRobin:
    """Each decision takes the next pod in turn; fallbacks are the ones after it.

    The turn counter is the only state a compiled policy carries; it restarts
    when a new policy is swapped in. ``next()`` on ``itertools.count`` is atomic,
    so concurrent decisions never take the same turn.
    """

    turns: itertools.count[int] = field(default_factory=itertools.count, compare=False)

    name: ClassVar[str] = "round-robin"
    uses_scores: ClassVar[bool] = False

    def pick(
        self, totals: Sequence[float] | None, count: int, fallbacks: int, rng: random.Random
    ) -> list[int]:
        start = next(self.turns) % count
        return [(start + step) % count for step in range(min(count, 1 + fallbacks))]
