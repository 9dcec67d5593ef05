"""The router reuses a filter-tree walk within one snapshot, and only when that is exact.

A walk may be reused for another request over the same candidate tuple when the
tree reads nothing but pod metrics and the request fields in its key; these
tests count how often pods are really looked at, and compare reused walks with
fresh ones on random pools.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from policyd.policy import Router
from policyd.policy.loader import load_policy_set
from policyd.pool.pod import Pod

from .helpers import RULES, pod, policy_set, request, router

QUEUE_TREE = """
    name: queue
    filters:
      short queue:
        keep: pod.waiting_queue < 10 && request.target_model in pod.active_loras
"""


class CountingPod:
    """A pod that counts how often a policy reads its queue length."""

    def __init__(self, inner: Pod, reads: list[str]) -> None:
        self._inner = inner
        self._reads = reads

    @property
    def waiting_queue(self) -> int:
        self._reads.append(self._inner.name)
        return self._inner.waiting_queue

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def counting_pods(reads: list[str]) -> tuple[CountingPod, ...]:
    return tuple(
        CountingPod(pod(f"p{i}", waiting_queue=i * 4, active_loras=("a", "b")), reads)
        for i in range(4)
    )


def test_the_default_tree_is_keyed_by_criticality_and_target_model() -> None:
    (policy,) = load_policy_set(RULES / "default.yaml").policies
    assert policy.walk_key is not None
    assert policy.walk_key(request("m", target_model="x", criticality="critical")) == (
        "critical",
        "x",
    )


@pytest.mark.parametrize(
    "keep",
    [
        "pod.in_flight < 3",  # moves with every request
        "request.headers['x-tier'] == 'gold'",  # differs per request
        "request.id != ''",
        "dyn(pod).waiting_queue < 3",  # the whole pod: any field may be read
    ],
)
def test_a_tree_reading_what_changes_per_request_is_walked_every_time(
    tmp_path: Path, keep: str
) -> None:
    loaded = policy_set(tmp_path, f"name: p\nfilters:\n  only:\n    keep: {keep}\n")
    assert loaded.policies[0].walk_key is None


def test_variables_count_with_what_they_read(tmp_path: Path) -> None:
    loaded = policy_set(
        tmp_path,
        """
        name: p
        variables:
          busy: pod.in_flight > 2
        filters:
          idle:
            keep: "!variables.busy"
        """,
    )
    assert loaded.policies[0].walk_key is None


def test_scorers_may_read_in_flight_without_stopping_reuse(tmp_path: Path) -> None:
    loaded = policy_set(
        tmp_path,
        """
        name: p
        filters:
          any:
            keep: pod.waiting_queue < 100
        score:
          idle: {weight: 1, expr: "1.0 / double(1 + pod.in_flight)"}
        pick: {strategy: max-score}
        """,
    )
    assert loaded.policies[0].walk_key is not None


def test_one_walk_per_key_and_snapshot(tmp_path: Path) -> None:
    decide = router(tmp_path, QUEUE_TREE).decide
    reads: list[str] = []
    snapshot = counting_pods(reads)
    first = decide(request("a"), snapshot)
    assert len(reads) == 4
    again = decide(request("a"), snapshot)
    assert len(reads) == 4  # the same walk, not a second look at the pods
    assert again.trace is first.trace and again.survivors == first.survivors == ("p0", "p1", "p2")
    decide(request("b"), snapshot)
    assert len(reads) == 8  # another target model is another key
    decide(request("a"), counting_pods(reads))
    assert len(reads) == 12  # a new snapshot (a new tuple) starts afresh
    decide(request("a"), list(snapshot))
    decide(request("a"), list(snapshot))
    assert len(reads) == 20  # a list may change in place: never reused


def test_a_tree_reading_in_flight_sees_every_change_on_the_same_snapshot(
    tmp_path: Path,
) -> None:
    decide = router(tmp_path, "name: p\nfilters:\n  idle:\n    keep: pod.in_flight == 0\n").decide
    snapshot = (pod("a"), pod("b"))
    assert decide(request(), snapshot).survivors == ("a", "b")
    snapshot[0].load.count += 1
    assert decide(request(), snapshot).survivors == ("b",)


def test_a_swapped_policy_does_not_reuse_the_old_policys_walks(tmp_path: Path) -> None:
    shed_all = policy_set(tmp_path, "name: p\nfilters:\n  none:\n    keep: 'false'\n", "b.yaml")
    keep_all = policy_set(tmp_path, "name: p\nfilters:\n  all:\n    keep: 'true'\n", "a.yaml")
    routing = Router(keep_all)
    snapshot = (pod("a"), pod("b"))
    assert routing.decide(request(), snapshot).survivors == ("a", "b")
    routing.store.swap(shed_all)
    assert routing.decide(request(), snapshot).outcome.value == "shed"


def test_reused_walks_match_fresh_walks_on_random_pools() -> None:
    """The seed tree over random snapshots: a long-lived router vs one per decision."""
    loaded = load_policy_set(RULES / "default.yaml")
    draw = random.Random(7)
    adapters = [f"adapter-{i}" for i in range(6)]
    long_lived = Router(loaded)
    compared = 0
    for _ in range(150):
        snapshot = tuple(
            pod(
                f"p{i}",
                waiting_queue=draw.choice([0, 1, 3, 6, 40, 60]),
                kv_cache=draw.choice([0.1, 0.5, 0.85]),
                active_loras=tuple(draw.sample(adapters, draw.randint(0, 3))),
                max_loras=draw.choice([0, 2, 4]),
            )
            for i in range(draw.randint(1, 8))
        )
        for _ in range(6):
            headers = {"x-gateway-inference-criticality": draw.choice(["critical", "standard"])}
            asked = request(draw.choice(adapters[:3]), headers)
            reused = long_lived.decide(asked, snapshot)
            fresh = Router(loaded).decide(asked, snapshot)
            assert (reused.outcome, reused.survivors, reused.reason) == (
                fresh.outcome,
                fresh.survivors,
                fresh.reason,
            )
            assert [t.kept for t in reused.trace] == [t.kept for t in fresh.trace]
            compared += 1
    assert compared == 900
