"""The prefix index's health, read when Prometheus scrapes: a custom collector.

Per pod of the pool (``model_server_endpoint``: its name), the blocks the
index holds for it (both modes) and, in precise mode, what its KV-event feed
did: batches applied, gaps in the sequence, publisher restarts, the pod's
entries cleared, batches replayed, malformed messages, dropped connections,
and the lag of the last live batch. The index and the feed name pods by
address; pods that left the pool are not reported.

Reads cross threads without locks: one dictionary look-up and attribute
reads per pod, on values the event loop replaces whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from policyd.pool.pod import PoolSnapshot
from policyd.telemetry.metrics import ENDPOINT


class FeedStatsLike(Protocol):
    """One pod's KV-event feed (``policyd.prefix.subscriber.FeedStats``)."""

    @property
    def batches(self) -> int: ...
    @property
    def gaps(self) -> int: ...
    @property
    def restarts(self) -> int: ...
    @property
    def clears(self) -> int: ...
    @property
    def replayed(self) -> int: ...
    @property
    def malformed(self) -> int: ...
    @property
    def disconnects(self) -> int: ...
    @property
    def lag_seconds(self) -> float | None: ...


class FeedsLike(Protocol):
    def stats(self, pod: str) -> FeedStatsLike | None: ...


class IndexLike(Protocol):
    def blocks(self, pod: str) -> int: ...


# FeedStats field -> counter family (without _total) and its help.
_FEED_COUNTERS: Final = (
    ("batches", "policyd_prefix_kv_event_batches", "KV-event batches applied, live and replayed."),
    ("gaps", "policyd_prefix_kv_event_gaps", "Jumps forward in the pod's KV-event sequence."),
    ("restarts", "policyd_prefix_kv_event_restarts",
     "The pod's KV-event publisher started counting anew (or the connection dropped)."),
    ("clears", "policyd_prefix_kv_event_clears",
     "Times the pod's index entries were dropped: a gap not replayed, a restart."),
    ("replayed", "policyd_prefix_kv_event_replayed_batches",
     "KV-event batches applied from the pod's replay socket."),
    ("malformed", "policyd_prefix_kv_event_malformed",
     "KV-event messages skipped whole as malformed."),
    ("disconnects", "policyd_prefix_kv_event_disconnects",
     "Dropped connections to the pod's KV-event publisher."),
)  # fmt: skip


class PrefixCollector(Collector):
    """Reports the prefix index and its KV-event feeds on every Prometheus scrape.

    ``feeds`` is None in approximate mode (no feeds: only the blocks are reported).
    """

    def __init__(
        self,
        index: IndexLike,
        feeds: FeedsLike | None,
        snapshots: Callable[[], PoolSnapshot],
    ) -> None:
        self._index = index
        self._feeds = feeds
        self._snapshots = snapshots

    def describe(self) -> list[Metric]:
        return []  # names are checked at collection; registering must not read the pool

    def collect(self) -> Iterator[Metric]:
        pods = self._snapshots().pods
        blocks = GaugeMetricFamily(
            "policyd_prefix_index_blocks",
            "Blocks the prefix index holds for the pod.",
            labels=[ENDPOINT],
        )
        for pod in pods:
            blocks.add_metric([pod.name], self._index.blocks(pod.address))
        yield blocks
        feeds = self._feeds
        if feeds is None:
            return
        counters = [
            (field, CounterMetricFamily(name, text, labels=[ENDPOINT]))
            for field, name, text in _FEED_COUNTERS
        ]
        lag = GaugeMetricFamily(
            "policyd_prefix_kv_event_lag_seconds",
            "From the last live KV-event batch's timestamp (the pod's clock) to its application.",
            labels=[ENDPOINT],
        )
        for pod in pods:
            stats = feeds.stats(pod.address)
            if stats is None:
                continue
            labels = [pod.name]
            for field, family in counters:
                family.add_metric(labels, getattr(stats, field))
            if stats.lag_seconds is not None:
                lag.add_metric(labels, stats.lag_seconds)
        for _, family in counters:
            yield family
        yield lag
