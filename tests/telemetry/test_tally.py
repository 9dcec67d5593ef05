"""Tallies export exactly what prometheus-client's own Counter and Histogram would."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from policyd.telemetry.tally import CounterTally, HistogramTally, TallyCollector

BUCKETS = (25e-6, 1e-3, 0.25, 1.0, 300.0)
LABELS = st.sampled_from([("a",), ("b",), ('a b\n"c',)])


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample but the ``_created`` ones, which tallies do not keep."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


@given(
    st.lists(
        st.tuples(LABELS, st.floats(min_value=0, max_value=1000, allow_nan=False)), max_size=40
    )
)
def test_histogram_matches_prometheus_client(observations: list[tuple[tuple[str], float]]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    tally = HistogramTally("x_seconds", "help", ["policy"], BUCKETS)
    ours.register(TallyCollector([tally]))
    reference = Histogram("x_seconds", "help", ["policy"], buckets=BUCKETS, registry=theirs)
    for labels, value in observations:
        tally.observe(labels, value)
        reference.labels(*labels).observe(value)
    assert samples(ours) == samples(theirs)


@given(st.lists(st.tuples(LABELS, st.integers(min_value=0, max_value=5)), max_size=40))
def test_counter_matches_prometheus_client(increments: list[tuple[tuple[str], int]]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    tally = CounterTally("things", "help", ["kind"])
    ours.register(TallyCollector([tally]))
    reference = Counter("things", "help", ["kind"], registry=theirs)
    for labels, amount in increments:
        tally.inc(labels, amount)
        reference.labels(*labels).inc(amount)
    assert samples(ours) == samples(theirs)


def test_the_text_format_names_counters_with_total_and_escapes_labels() -> None:
    registry = CollectorRegistry()
    tally = CounterTally("policyd_things", "Things seen.", ["kind"])
    registry.register(TallyCollector([tally]))
    tally.inc(('say "hi"',), 2)
    text = generate_latest(registry).decode()
    assert "# TYPE policyd_things_total counter" in text
    assert 'policyd_things_total{kind="say \\"hi\\""} 2.0' in text


def test_drop_forgets_label_sets() -> None:
    tally = CounterTally("things", "help", ["pod"])
    for pod in ("a", "b", "c"):
        tally.inc((pod,))
    tally.drop(lambda labels: labels[0] != "b")
    assert sorted(tally.values) == [("a",), ("c",)]


def test_a_duplicate_name_is_refused_at_registration() -> None:
    registry = CollectorRegistry()
    Counter("things", "help", registry=registry)
    with pytest.raises(ValueError, match="things"):
        registry.register(TallyCollector([CounterTally("things", "help", [])]))


def test_scrapes_while_the_loop_writes_see_whole_counts() -> None:
    """A scrape on another thread never fails and never sees a count go backwards.

    The writes go on until the reader has scraped several counts while they
    were running (however the threads get scheduled), so the test cannot pass
    without scrapes racing the writes.
    """
    registry = CollectorRegistry()
    counter = CounterTally("things", "help", ["pod"])
    histogram = HistogramTally("took_seconds", "help", ["pod"], BUCKETS)
    registry.register(TallyCollector([counter, histogram]))
    done = threading.Event()
    seen: list[float] = []
    failures: list[BaseException] = []

    def scrape() -> None:
        try:
            while not done.is_set():
                generate_latest(registry)
                seen.append(sum(sample.value for sample in counter.family().samples))
        except BaseException as error:  # reported below
            failures.append(error)

    def scraped_mid_write() -> set[float]:
        return {count for count in seen if count > 0}

    reader = threading.Thread(target=scrape)
    reader.start()
    written = 0
    deadline = time.monotonic() + 60
    try:
        while len(scraped_mid_write()) < 5 and time.monotonic() < deadline and not failures:
            for _ in range(1000):
                counter.inc(("p",))
                histogram.observe((f"p{written % 50}",), 0.001)
                written += 1
    finally:
        done.set()
        reader.join()
    assert not failures
    assert len(scraped_mid_write()) >= 5, "the reader never scraped while the writes ran"
    assert seen == sorted(seen)
    assert counter.values[("p",)] == written
    counts = histogram.family().samples
    assert sum(sample.value for sample in counts if sample.name.endswith("_count")) == written
