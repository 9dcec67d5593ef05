"""Snapshots: what is a candidate, what survives a swap, when the pool is ready."""

from __future__ import annotations

import dataclasses

import mypy.api
import pytest

from policyd.cel.values import Duration
from policyd.pool.datastore import Datastore, PoolSnapshot
from policyd.pool.discovery import PodIdentity
from policyd.pool.exposition import PodMetrics
from policyd.pool.pod import Pod
from policyd.pool.scraper import ScrapeResult


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


A = PodIdentity.of("a", "10.0.0.1:8000", {"zone": "x"})
B = PodIdentity.of("b", "10.0.0.2:8000")
METRICS = PodMetrics(waiting_queue=2, running=3, kv_cache=0.5, active_loras=("l1",), max_loras=4)


def ok(identity: PodIdentity, metrics: PodMetrics = METRICS) -> ScrapeResult:
    return ScrapeResult(identity.address, metrics, None, 0.002)


def failed(identity: PodIdentity, error: str = "no answer within 75 ms") -> ScrapeResult:
    return ScrapeResult(identity.address, None, error, 0.075)


def store(clock: Clock, **kwargs: object) -> Datastore:
    return Datastore(stale_after=0.5, clock=clock, **kwargs)  # type: ignore[arg-type]


def names(pods: tuple[object, ...]) -> list[str]:
    return [pod.name for pod in pods]  # type: ignore[attr-defined]


def test_scraped_pods_become_candidates_with_their_metrics() -> None:
    clock = Clock()
    data = store(clock)
    data.set_pods([B, A])
    assert data.snapshot.pods and not data.snapshot.candidates
    clock.now += 0.01
    data.record([ok(A), ok(B)])
    snapshot = data.snapshot
    assert names(snapshot.pods) == ["a", "b"]
    assert names(snapshot.candidates) == ["a", "b"]
    pod = snapshot.pods[0]
    assert (pod.name, pod.address, dict(pod.labels)) == ("a", "10.0.0.1:8000", {"zone": "x"})
    assert (pod.waiting_queue, pod.running, pod.kv_cache) == (2, 3, 0.5)
    assert (pod.active_loras, pod.waiting_loras, pod.max_loras) == (("l1",), (), 4)
    assert pod.metrics_age == Duration(0)
    assert snapshot.ready and snapshot.scrape_round == 1


def test_a_pod_whose_scrape_failed_is_not_a_candidate() -> None:
    clock = Clock()
    data = store(clock)
    data.set_pods([A, B])
    data.record([ok(A), ok(B)])
    clock.now += 0.1
    data.record([ok(A), failed(B)])
    assert names(data.snapshot.candidates) == ["a"]
    pod_b = data.snapshot.pods[1]
    assert pod_b.metrics_age == Duration.from_seconds(0.1)
    assert pod_b.running == 3  # the last good metrics stay visible
    stats = data.stats[B.address]
    assert (stats.successes, stats.failures, stats.consecutive_failures) == (1, 1, 1)
    assert stats.last_error == "no answer within 75 ms"
    assert stats.last_success_round == 1


def test_metrics_older_than_the_threshold_are_stale() -> None:
    clock = Clock()
    data = store(clock)
    data.set_pods([A])
    data.record([ok(A)])
    clock.now += 0.5
    data.set_pods([A])  # publishes with ages measured to now
    assert names(data.snapshot.candidates) == ["a"]
    clock.now += 0.001
    data.set_pods([A])
    assert data.snapshot.candidates == ()
    assert data.snapshot.pods[0].metrics_age == Duration.from_seconds(0.501)


def test_when_no_pod_answers_a_round_those_recently_heard_stay_candidates_until_stale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    data = store(clock)
    data.set_pods([A, B])
    data.record([ok(A), ok(B)])
    rounds = [
        # (seconds later, A answers, B answers) -> (candidates, panic)
        ((0.1, False, False), (["a", "b"], True)),  # the scraper, not the pods, is in trouble
        ((0.1, True, False), (["a"], False)),  # one pod failing leaves at once
        ((0.1, False, False), (["a", "b"], True)),  # b last answered 0.3 s ago
        ((0.31, False, False), (["a"], True)),  # b's metrics are now 0.61 s old: stale
        ((0.1, False, False), ([], False)),  # a's too: no pod to route to
    ]
    with caplog.at_level("INFO", logger="policyd.pool.datastore"):
        for (later, a_answers, b_answers), (candidates, panic) in rounds:
            clock.now += later
            data.record([ok(A) if a_answers else failed(A), ok(B) if b_answers else failed(B)])
            assert (names(data.snapshot.candidates), data.snapshot.panic) == (candidates, panic)
    panics = [r.getMessage() for r in caplog.records if "no pod answered the last" in r.message]
    assert len(panics) == 2  # once per panic, not once per round
    assert "routing on the 2 pods whose metrics are at most 0.5 s old" in panics[0]
    assert [r.levelname for r in caplog.records if "panic over" in r.message] == ["INFO"]


def pool_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if "panic" not in r.message]


def test_every_failing_pod_is_logged_with_its_reason_even_when_many_fail_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 17 pods failing in one round, each for its own reason: every reason is
    # seen (a summary line naming three of them hid the other fourteen).
    pods = [PodIdentity.of(f"p{i}", f"10.0.1.{i}:8000") for i in range(20)]
    clock = Clock()
    data = store(clock)
    data.set_pods(pods)
    data.record([ok(p) for p in pods])
    with caplog.at_level("INFO", logger="policyd.pool.datastore"):
        clock.now += 0.1
        data.record(
            [failed(p, f"reason {i}") for i, p in enumerate(pods[:17])] + [ok(p) for p in pods[17:]]
        )
        clock.now += 0.1
        data.record([ok(p) for p in pods])
    assert pool_lines(caplog) == [
        ("WARNING", f"metrics scrape of pod p{i} (10.0.1.{i}:8000) failed: reason {i}")
        for i in range(17)
    ] + [
        ("INFO", f"pod p{i} (10.0.1.{i}:8000) answers its metrics scrape again, after 1 failed")
        for i in range(17)
    ]


def test_a_failing_pod_is_logged_again_when_its_reason_changes_at_most_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    data = store(clock, failure_log_interval=30.0)
    data.set_pods([A, B])  # B answers throughout: no panic
    data.record([ok(A), ok(B)])
    pod = "metrics scrape of pod a (10.0.0.1:8000) failed"
    rounds = [
        # (seconds later, reason or None for an answer) -> line logged
        ((0.1, "connection refused"), ("WARNING", f"{pod}: connection refused")),
        ((0.1, "connection refused"), None),  # the same reason: said already
        ((10.0, "no answer within 75 ms"), None),  # a new reason, but within the interval
        ((10.0, "no answer within 75 ms"), None),
        (
            (10.0, "no answer within 75 ms"),  # 30.2 s after the first line
            (
                "WARNING",
                f"{pod}: no answer within 75 ms"
                " (3 failed scrapes not logged since the last line about it)",
            ),
        ),
        ((40.0, "no answer within 75 ms"), None),  # unchanged: never repeated
        (
            (0.1, None),
            ("INFO", "pod a (10.0.0.1:8000) answers its metrics scrape again, after 6 failed"),
        ),
    ]
    for (later, reason), line in rounds:
        caplog.clear()
        with caplog.at_level("INFO", logger="policyd.pool.datastore"):
            clock.now += later
            data.record([ok(A) if reason is None else failed(A, reason), ok(B)])
        assert pool_lines(caplog) == ([] if line is None else [line]), (later, reason)


def test_a_flapping_pod_logs_a_failure_and_a_recovery_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    data = store(clock, failure_log_interval=30.0)
    data.set_pods([A, B])
    data.record([ok(A), ok(B)])
    with caplog.at_level("INFO", logger="policyd.pool.datastore"):
        for i in range(600):  # 60 s of a round every 0.1 s, A failing every other round
            clock.now += 0.1
            data.record([failed(A) if i % 2 == 0 else ok(A), ok(B)])
    lines = pool_lines(caplog)
    assert [level for level, _ in lines] == ["WARNING", "INFO", "WARNING", "INFO"]
    assert lines[0][1] == "metrics scrape of pod a (10.0.0.1:8000) failed: no answer within 75 ms"
    assert lines[2][1].endswith("(150 failed scrapes not logged since the last line about it)")


def test_a_pod_that_never_answered_is_no_candidate_even_in_a_panic() -> None:
    clock = Clock()
    data = store(clock)
    data.set_pods([A, B])
    data.record([ok(A), failed(B)])
    clock.now += 0.1
    data.record([failed(A), failed(B)])
    assert (names(data.snapshot.candidates), data.snapshot.panic) == (["a"], True)


def test_without_panic_a_round_no_pod_answers_leaves_no_candidates(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    data = store(clock, panic=False)
    data.set_pods([A, B])
    data.record([ok(A), ok(B)])
    clock.now += 0.1
    with caplog.at_level("INFO", logger="policyd.pool.datastore"):
        data.record([failed(A), failed(B)])
    assert (data.snapshot.candidates, data.snapshot.panic) == ((), False)
    assert not [r for r in caplog.records if "no pod answered the last" in r.message]
    clock.now += 0.1
    data.record([ok(A), failed(B)])
    assert names(data.snapshot.candidates) == ["a"]


def test_include_stale_keeps_pods_that_answered_once_but_never_silent_ones() -> None:
    clock = Clock()
    data = store(clock, include_stale=True)
    data.set_pods([A, B])
    data.record([ok(A), failed(B)])
    clock.now += 10
    data.record([failed(A), failed(B)])
    assert names(data.snapshot.candidates) == ["a"]
    assert data.snapshot.pods[0].metrics_age == Duration.from_seconds(10)


def test_a_pod_that_never_answered_ages_from_its_discovery() -> None:
    clock = Clock()
    data = store(clock)
    data.set_pods([A])
    clock.now += 2
    data.record([failed(A, "cannot connect: Connection refused")])
    pod = data.snapshot.pods[0]
    assert pod.metrics_age == Duration.from_seconds(2)
    assert (pod.running, pod.kv_cache) == (0, 0.0)
    assert data.snapshot.candidates == ()
    assert data.snapshot.ready  # tried once: a dead pod does not hold readiness hostage


def test_ready_needs_pods_and_one_scrape_of_each() -> None:
    clock = Clock()
    data = store(clock)
    assert not data.snapshot.ready
    data.set_pods([])
    assert not data.snapshot.ready
    data.set_pods([A, B])
    assert not data.snapshot.ready
    data.record([ok(A)])
    assert not data.snapshot.ready
    data.record([ok(A), failed(B)])
    assert data.snapshot.ready


def test_readiness_does_not_flap_when_pods_are_added_but_ends_with_an_empty_pool() -> None:
    clock = Clock()
    data = store(clock)
    data.set_pods([A])
    data.record([ok(A)])
    data.set_pods([A, B])  # scaled up: B not scraped yet
    assert data.snapshot.ready
    assert names(data.snapshot.candidates) == ["a"]
    data.set_pods([])
    assert not data.snapshot.ready
    data.set_pods([B])
    assert not data.snapshot.ready
    data.record([ok(B)])
    assert data.snapshot.ready


def test_a_repeated_address_keeps_the_first_name() -> None:
    clock = Clock()
    data = store(clock)
    data.set_pods([PodIdentity.of("z", A.address), A])
    assert names(data.snapshot.pods) == ["a"]


def test_in_flight_counts_survive_swaps_and_leave_with_the_pod() -> None:
    clock = Clock()
    data = store(clock)
    data.set_pods([A, B])
    data.record([ok(A), ok(B)])
    first = data.snapshot.pods[0]
    first.load.count += 3
    data.record([ok(A), ok(B)])
    assert data.snapshot.pods[0].in_flight == 3
    assert data.snapshot.pods[0].load is first.load
    data.set_pods([B])
    data.set_pods([A, B])
    assert data.snapshot.pods[0].in_flight == 0
    assert first.in_flight == 3  # a request still holding the old pod decrements its own counter


def test_a_pod_relabelled_at_the_same_address_keeps_its_state() -> None:
    clock = Clock()
    data = store(clock)
    data.set_pods([A])
    data.record([ok(A)])
    data.snapshot.pods[0].load.count = 1
    renamed = PodIdentity.of("a-new-name", A.address, {"zone": "y"})
    data.set_pods([renamed])
    pod = data.snapshot.pods[0]
    assert (pod.name, dict(pod.labels), pod.running, pod.in_flight) == (
        "a-new-name",
        {"zone": "y"},
        3,
        1,
    )
    assert names(data.snapshot.candidates) == ["a-new-name"]


def test_results_for_pods_that_left_during_the_round_are_dropped() -> None:
    clock = Clock()
    data = store(clock)
    data.set_pods([A])
    data.record([ok(A), ok(B)])
    assert names(data.snapshot.pods) == ["a"]
    assert B.address not in data.stats


def test_snapshots_are_immutable_and_old_ones_never_change() -> None:
    clock = Clock()
    published: list[PoolSnapshot] = []
    data = store(clock, on_publish=published.append)
    data.set_pods([A])
    old = data.snapshot
    data.record([ok(A)])
    assert old.candidates == () and old.version == 1
    assert data.snapshot.version == 2
    assert published == [old, data.snapshot]
    with pytest.raises(dataclasses.FrozenInstanceError):
        data.snapshot.candidates = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        data.snapshot.pods[0].labels["zone"] = "z"  # type: ignore[index]


def test_the_type_checker_rejects_any_change_to_a_pod() -> None:
    """Pods are read-only to mypy rather than frozen at run time (``Pod``'s
    docstring says why), so mypy, which CI runs over policyd, is what must refuse them."""
    fields = [field.name for field in dataclasses.fields(Pod)]
    program = "from policyd.pool.pod import Pod\npod = Pod('a', '10.0.0.1:8000')\n"
    program += "".join(f"print(pod.{name})\npod.{name} = pod.{name}\n" for name in fields)
    report, _, status = mypy.api.run(
        ["--config-file=", "--cache-dir=/dev/null", "--follow-imports=silent", "-c", program]
    )
    errors = [line for line in report.splitlines() if ": error:" in line]
    assert status == 1
    # Every field is typed, and final: no read is an error, every assignment is.
    assert [line.split(": error:")[0] for line in errors] == [
        f"<string>:{4 + 2 * i}" for i in range(len(fields))
    ]
    for line in errors:
        assert "Cannot assign to final attribute" in line, line


def test_unchanged_pods_keep_their_objects_and_the_candidates_tuple() -> None:
    """Rounds that change nothing keep what policies worked out over the candidates
    valid; a changed metric, a failure or a relabel gives new objects."""
    clock = Clock()
    data = store(clock)
    data.set_pods([A, B])
    data.record([ok(A), ok(B)])
    first = data.snapshot
    clock.now += 0.1
    data.record([ok(A), ok(B, PodMetrics(*METRICS))])  # equal values, new objects
    second = data.snapshot
    assert second.version == first.version + 1 and second.scrape_round == 2
    assert second.candidates is first.candidates and second.pods is first.pods

    clock.now += 0.1
    data.record([ok(A), ok(B, METRICS._replace(waiting_queue=7))])
    third = data.snapshot
    assert third.candidates is not second.candidates
    assert third.candidates[0] is second.candidates[0]  # a: unchanged
    assert third.candidates[1].waiting_queue == 7

    clock.now += 0.1
    data.record([ok(A), failed(B)])  # b is still a pod, no longer a candidate, and ages
    fourth = data.snapshot
    assert names(fourth.candidates) == ["a"] and fourth.pods[1] is not third.pods[1]
    assert fourth.pods[1].metrics_age == Duration.from_seconds(0.1)

    data.set_pods([PodIdentity.of("a", A.address, {"zone": "y"}), B])
    assert dict(data.snapshot.pods[0].labels) == {"zone": "y"}
    assert data.snapshot.candidates[0] is not fourth.candidates[0]
