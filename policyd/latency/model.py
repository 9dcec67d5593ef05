"""One pod's online latency model: recursive least squares over a few load features.

TTFT is linear enough in what a pod has to do before it starts the request
(the uncached prompt tokens to prefill, the requests queued and running
ahead of it, its KV-cache use, what policyd has in flight there), and TPOT
in its batch and the context it carries, for a least-squares fit to track
them as load changes; benchmarks/slo_models.py measures this family against
a bucketed median and a log-target fit on the simulator and chose it
(benchmarks/RESULTS.md). Recursive least squares learns from each outcome as
it arrives, in a few dozen multiplications, with a forgetting factor so that
old load regimes fade.

``Learner`` is mutable and only the serving path's event loop updates it;
each update publishes a new immutable ``Fit`` (a tuple of coefficients),
which decisions read by reference, with no lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import mul
from typing import Final, NamedTuple

FORGET: Final = 0.995  # each older outcome weighs this much less: ~200 outcomes of memory
PRIOR: Final = 1000.0  # the initial uncertainty of every coefficient
# A warm fit moves by at most half its prediction per outcome: robust to the outliers
# (a request that waited behind a long prefill) that would drag a least-squares mean.
CLIP: Final = 0.5
WARM: Final = 16  # outcomes before a fit predicts: fewer than the features leave it unfit


class Fit(NamedTuple):
    """One published fit: coefficients per feature, and how many outcomes made it."""

    coefficients: tuple[float, ...]
    samples: int

    def predict(self, features: Sequence[float]) -> float:
        total = 0.0
        for c, x in zip(self.coefficients, features, strict=True):
            total += c * x
        return total


class Learner:
    """Recursive least squares with forgetting over ``width`` features.

    Outcomes whose values are not finite and positive are ignored, so a pod
    that answers nonsense cannot make the fit nonsense.
    """

    __slots__ = ("_p", "_theta", "fit", "width")

    def __init__(self, width: int) -> None:
        self.width = width
        self._theta = [0.0] * width
        self._p = [[PRIOR if i == j else 0.0 for j in range(width)] for i in range(width)]
        self.fit = Fit(tuple(self._theta), 0)

    def learn(self, features: Sequence[float], value: float) -> None:
        if len(features) != self.width or not 0.0 < value < float("inf"):
            return
        if not sum(map(abs, features)) < 1e12:  # also false for NaN
            return
        p, theta = self._p, self._theta
        x = features
        # Sums over zipped rows rather than indexed loops: this runs once per answer.
        px = [sum(map(mul, row, x)) for row in p]
        denominator = FORGET + sum(map(mul, x, px))
        gain = [v / denominator for v in px]
        predicted = sum(map(mul, theta, x))
        error = value - predicted
        if self.fit.samples >= WARM:
            bound = CLIP * max(abs(predicted), 1.0)
            error = min(max(error, -bound), bound)
        for i, g in enumerate(gain):
            theta[i] += g * error
        # P = (P - gain * (x' P)) / forget; x' P is px transposed (P is symmetric).
        scale = 1.0 / FORGET
        self._p = [
            [(v - g * q) * scale for v, q in zip(row, px, strict=True)]
            for row, g in zip(p, gain, strict=True)
        ]
        self.fit = Fit(tuple(theta), self.fit.samples + 1)
