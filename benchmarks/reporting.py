"""How the benchmarks state their figures: goal verdicts and nearest-rank percentiles.

Declared once so that every script marks a goal and reads a latency tail the
same way (the quality benchmarks' ``met``/``MISSED`` lines, the load
benchmarks' p50/p99 columns).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def verdict(met: bool) -> str:
    """A goal's mark: ``met``, or ``MISSED`` in capitals so that it stands out in a table."""
    return "met" if met else "MISSED"


def nearest_rank(values: Sequence[float], share: float) -> float:
    """The sample at ``share`` of the sorted ``values`` (``nan`` when empty).

    A sample that was measured, never one interpolated between two: a latency
    tail reads as a request that happened.
    """
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]
