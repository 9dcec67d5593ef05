"""Pickers: choose the endpoint, and the fallbacks, among the survivors.

All share one shape: ``pick(totals, count, fallbacks, rng) -> indices`` where
the first index is the chosen pod and the rest are fallbacks, best first, all
distinct and at most ``count`` of them. ``totals`` is None for pickers that do
not use scores (the router then skips scoring altogether).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
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


Picker = MaxScore | WeightedRandom | RoundRobin | UniformRandom


def picker_for(strategy: str) -> Picker:
    pickers: dict[str, type[Picker]] = {
        MaxScore.name: MaxScore,
        WeightedRandom.name: WeightedRandom,
        RoundRobin.name: RoundRobin,
        UniformRandom.name: UniformRandom,
    }
    return pickers[strategy]()
