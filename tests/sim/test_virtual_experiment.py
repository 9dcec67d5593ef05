"""The seed experiment in virtual time: calibration, determinism, what the router sees."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from policyd.sim.experiment import (
    PodView,
    RoutedRequest,
    SeedWorkload,
    percentile,
    run_experiment,
    uniform_random,
)
from policyd.sim.virtual import VirtualLoop

PUBLISHED_SERVICE_COMPLETED = 484
PUBLISHED_SERVICE_TOKENS_PER_S = 640


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uniform_random_routing_reproduces_the_published_kubernetes_service_result(
    seed: int,
) -> None:
    result = run_experiment(uniform_random, seed=seed)
    assert len(result.records) == 1000
    assert result.duration_s == pytest.approx(300.0)
    assert result.completed == pytest.approx(PUBLISHED_SERVICE_COMPLETED, rel=0.15)
    assert result.output_tokens_per_s == pytest.approx(PUBLISHED_SERVICE_TOKENS_PER_S, rel=0.15)


def test_the_same_seed_gives_the_same_run_and_another_seed_another() -> None:
    small = SeedWorkload(requests=120, connections=20, max_tokens=200, timeout_s=60.0)
    first = run_experiment(uniform_random, workload=small, pods=3, seed=4)
    again = run_experiment(uniform_random, workload=small, pods=3, seed=4)
    other = run_experiment(uniform_random, workload=small, pods=3, seed=5)
    assert first == again
    assert first.records != other.records


class Spy:
    """A routing function that remembers what it was shown, then picks the least loaded."""

    def __init__(self) -> None:
        self.calls: list[tuple[RoutedRequest, Sequence[PodView]]] = []

    def __call__(self, request: RoutedRequest, pods: Sequence[PodView], rng: random.Random) -> int:
        self.calls.append((request, pods))
        return min(pods, key=lambda pod: (pod.in_flight, pod.index)).index


def test_the_router_sees_scraped_metrics_of_their_age_and_its_own_in_flight_count() -> None:
    workload = SeedWorkload(requests=60, connections=6, adapters=3, max_tokens=60)
    spy = Spy()
    result = run_experiment(spy, workload=workload, pods=2, seed=1, scrape_interval_s=0.5)
    assert result.completed == 60
    assert len(spy.calls) == 60
    # the first six requests all get a connection at once and see empty metrics
    first_wave = spy.calls[:6]
    assert all(request.started_at == 0.0 for request, _ in first_wave)
    assert [[pod.in_flight for pod in pods] for _, pods in first_wave] == [
        [0, 0],
        [1, 0],
        [1, 1],
        [2, 1],
        [2, 2],
        [3, 2],
    ]
    assert all(
        pod.running == 0 and pod.metrics_age == 0.0 for _, pods in first_wave for pod in pods
    )
    ages = [pod.metrics_age for _, pods in spy.calls for pod in pods]
    assert all(0.0 <= age < 0.5 + 1e-9 for age in ages)
    assert max(ages) > 0.1  # staleness is real, not always zero
    later = [pods for _, pods in spy.calls[6:]]
    assert any(pod.running > 0 and pod.running_adapters for pods in later for pod in pods)
    # requests are routed when they get a connection: six in flight at every decision
    assert all(sum(pod.in_flight for pod in pods) == 5 for pods in later)


def test_requests_time_out_counting_from_their_start_including_the_pool_wait() -> None:
    workload = SeedWorkload(requests=30, connections=2, adapters=1, max_tokens=750, timeout_s=20.0)
    result = run_experiment(uniform_random, workload=workload, pods=1, seed=0)
    assert result.duration_s == pytest.approx(20.0)
    assert 0 < result.completed < 30
    assert all(r.finished is not None and r.finished <= 20.0 for r in result.records if r.completed)
    never_sent = [r for r in result.records if r.sent is None]
    assert never_sent and all(not r.completed for r in never_sent)
    assert all(latency <= 20.0 for latency in result.latency_s())
    assert result.generated_tokens_per_s > result.output_tokens_per_s


def test_a_routing_function_naming_a_missing_pod_is_an_error() -> None:
    workload = SeedWorkload(requests=1, connections=1)
    with pytest.raises(ValueError, match="chose pod 7 of 2"):
        run_experiment(lambda request, pods, rng: 7, workload=workload, pods=2)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile([5.0], 0.99) == 5.0
    assert percentile([], 0.5) != percentile([], 0.5)  # nan


def test_the_virtual_loop_runs_events_in_time_order_and_skips_cancelled_ones() -> None:
    loop = VirtualLoop()
    seen: list[tuple[float, str]] = []
    loop.call_at(2.0, lambda: seen.append((loop.now, "late")))
    loop.call_at(1.0, lambda: seen.append((loop.now, "first")))
    loop.call_at(1.0, lambda: seen.append((loop.now, "second")))
    loop.call_at(1.5, lambda: seen.append((loop.now, "cancelled"))).cancel()
    loop.run()
    assert seen == [(1.0, "first"), (1.0, "second"), (2.0, "late")]
    with pytest.raises(ValueError, match="cannot schedule"):
        loop.call_at(1.0, lambda: None)


@pytest.mark.parametrize(
    "changes",
    [{"connections": 0}, {"adapters": 0}, {"prompt": ()}, {"max_tokens": 0}, {"timeout_s": 0.0}],
)
def test_a_workload_that_cannot_run_is_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="a workload needs"):
        SeedWorkload(**changes)


def test_the_documented_example_prints_what_docs_simulator_md_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "simulator.md").read_text()
    match = re.search(r"```python\n(.*?)```", doc, flags=re.DOTALL)
    assert match is not None
    example = match.group(1)
    printed = re.search(r"^print\(.*\)\s+# (.*)$", example, flags=re.MULTILINE)
    assert printed is not None
    exec(compile(example, "docs/simulator.md", "exec"), {})
    assert capsys.readouterr().out == printed.group(1) + "\n"
