"""What a picker is: it chooses the endpoint, and the fallbacks, among the survivors.

Each picker is one class in ``policyd.policy.kinds``, registered by its
``pick.strategy`` name. All share one shape: ``pick(totals, count, fallbacks,
rng) -> indices`` where the first index is the chosen pod and the rest are
fallbacks, best first, all distinct and at most ``count`` of them. ``totals``
is None for pickers that do not use scores (the router then skips scoring
altogether). A compiled policy holds one picker object, made when it loads.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol


class Picker(Protocol):
    @property
    def name(self) -> str:
        """The ``pick.strategy`` that chooses it; shown by ``check`` and ``explain``."""
        ...

    @property
    def uses_scores(self) -> bool: ...

    def pick(
        self, totals: Sequence[float] | None, count: int, fallbacks: int, rng: random.Random
    ) -> list[int]: ...
