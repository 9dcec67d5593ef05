"""What one engine counts while it runs: the raw material of its ``/metrics``.

Plain numbers updated at step boundaries; ``exposition`` turns them into the
Prometheus text vLLM serves. Histogram buckets are vLLM V0's, so dashboards and
alerts written against vLLM read the simulator the same way.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

TTFT_BUCKETS: Final = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5),
    *(0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
)
TPOT_BUCKETS: Final = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS: Final = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0),
    *(20.0, 30.0, 40.0, 50.0, 60.0),
)
# vLLM's NixlConnector histograms (its KV-transfer Prometheus metrics).
NIXL_XFER_TIME_BUCKETS: Final = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    5.0,
)
NIXL_POST_TIME_BUCKETS: Final = (0.001, *NIXL_XFER_TIME_BUCKETS)
NIXL_BYTES_BUCKETS: Final = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))  # 2 KiB..8 GiB

# vLLM keeps every lora_requests_info series it ever set; a long run would grow
# /metrics without bound, so the simulator keeps the most recent ones only.
LORA_SERIES_KEPT: Final = 32


class Histogram:
    """A Prometheus histogram: upper bounds, per-bucket counts, sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= bound)``, ending with ``(inf, count)``."""
        running = 0
        buckets: list[tuple[float, int]] = []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            buckets.append((bound, running))
        return buckets


@dataclass(slots=True)
class EngineStats:
    """Counters and histograms of one engine since it started (durations in sim seconds)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    # KV transfers this pod read from prefill pods (decode side, as vLLM counts them).
    nixl_xfer_time: Histogram = field(default_factory=lambda: Histogram(NIXL_XFER_TIME_BUCKETS))
    nixl_post_time: Histogram = field(default_factory=lambda: Histogram(NIXL_POST_TIME_BUCKETS))
    nixl_bytes_transferred: Histogram = field(default_factory=lambda: Histogram(NIXL_BYTES_BUCKETS))
    # (running adapters, waiting adapters) -> sim time that combination was last
    # current, least recently current first.
    lora_series: dict[tuple[str, str], float] = field(default_factory=dict)
