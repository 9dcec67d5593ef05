"""Counters and histograms for the serving path: written by one thread, read by scrapes.

prometheus-client's ``Counter.inc`` and ``Histogram.observe`` take a lock
and check the metric's state on every call; a decision under the default
policy makes some twenty of them, a large share of policyd's own Python per
request. Every per-request metric is written from the event
loop alone, so it needs no lock: a tally is a plain dict from label values to
a number (or to a histogram row), updated in place, and a Prometheus scrape
on the metrics thread reads a copy (``dict.copy`` and ``list`` copies are
atomic under the GIL). A scrape may see a histogram row between its bucket
and its sum being updated, one observation apart, never a torn number.

Dropping label sets (pods that left the pool) happens on the scrape's
thread; a decision for such a pod racing the drop at worst brings its series
back until the next scrape drops it again.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

Labels = tuple[str, ...]
_le_label: Callable[[float], str] = floatToGoString  # ``le`` exactly as prometheus-client prints it


class CounterTally:
    """A labelled counter; exported as ``<name>_total``."""

    __slots__ = ("documentation", "label_names", "name", "values")

    def __init__(self, name: str, documentation: str, label_names: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.label_names = tuple(label_names)
        self.values: dict[Labels, float] = {}

    def inc(self, labels: Labels, amount: float = 1) -> None:
        values = self.values
        values[labels] = values.get(labels, 0) + amount

    def drop(self, keep: Callable[[Labels], bool]) -> None:
        """Forget every label set for which ``keep(labels)`` is false."""
        for labels in [labels for labels in self.values.copy() if not keep(labels)]:
            self.values.pop(labels, None)

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.label_names)
        for labels, value in self.values.copy().items():
            family.add_metric(labels, value)
        return family


class HistogramTally:
    """A labelled histogram with fixed bucket bounds (``le`` is inclusive, as Prometheus has it)."""

    __slots__ = ("_bounds", "_le", "documentation", "label_names", "name", "rows")

    def __init__(
        self,
        name: str,
        documentation: str,
        label_names: Sequence[str],
        buckets: Sequence[float],
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.label_names = tuple(label_names)
        self._bounds = tuple(sorted(buckets))
        self._le = (*(_le_label(bound) for bound in self._bounds), "+Inf")
        # Per label set: a count per bucket (the last one past every bound), then the sum.
        self.rows: dict[Labels, list[float]] = {}

    def observe(self, labels: Labels, value: float) -> None:
        row = self.rows.get(labels)
        if row is None:
            row = self.rows[labels] = [0.0] * (len(self._bounds) + 2)
        row[bisect_left(self._bounds, value)] += 1
        row[-1] += value

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.label_names)
        for labels, live in self.rows.copy().items():
            row = list(live)
            cumulative = 0.0
            buckets = []
            for le, count in zip(self._le, row, strict=False):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(labels, buckets, row[-1])
        return family


class TallyCollector(Collector):
    """Exports tallies through a prometheus-client registry."""

    def __init__(self, tallies: Sequence[CounterTally | HistogramTally]) -> None:
        self._tallies = tuple(tallies)

    def describe(self) -> list[Metric]:
        """The families without samples, so the registry can refuse duplicate names."""
        return [
            CounterMetricFamily(t.name, t.documentation, labels=t.label_names)
            if isinstance(t, CounterTally)
            else HistogramMetricFamily(t.name, t.documentation, labels=t.label_names)
            for t in self._tallies
        ]

    def collect(self) -> Iterator[Metric]:
        for tally in self._tallies:
            yield tally.family()
