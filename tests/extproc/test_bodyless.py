"""The pod a body-less request (``GET /v1/models``) goes to."""

from __future__ import annotations

import random
from collections import Counter

from policyd.extproc.bodyless import least_busy_pod
from policyd.policy.decision import Outcome
from policyd.pool.pod import Pod


def pods_in_flight(*counts: int) -> tuple[Pod, ...]:
    pods = tuple(Pod(f"p{i}", f"10.0.0.{i}:8000") for i in range(len(counts)))
    for pod, count in zip(pods, counts, strict=True):
        pod.load.count = count
    return pods


def test_the_pod_with_the_fewest_requests_in_flight_is_chosen() -> None:
    pods = pods_in_flight(3, 1, 2)
    decision = least_busy_pod(pods, random.Random(0))
    assert (decision.outcome, decision.pod, decision.endpoint) == (
        Outcome.ROUTED,
        "p1",
        "10.0.0.1:8000",
    )
    assert decision.chosen is pods[1]
    assert decision.survivors == ("p1",)


def test_a_tie_is_broken_at_random_among_the_tied_pods_only() -> None:
    pods = pods_in_flight(0, 4, 0, 0)
    rng = random.Random(7)
    chosen = Counter(least_busy_pod(pods, rng).pod for _ in range(300))
    assert set(chosen) == {"p0", "p2", "p3"}
    assert min(chosen.values()) > 60  # each of the three about a third of the time


def test_no_candidates_is_no_capacity() -> None:
    decision = least_busy_pod((), random.Random(0))
    assert (decision.outcome, decision.reason) == (Outcome.NO_CAPACITY, "no ready pods")
