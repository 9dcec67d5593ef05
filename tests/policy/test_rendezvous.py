"""Rendezvous-hashing scorers: stable homes per key, bounded by other scorers, clear errors."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from policyd.policy import Outcome
from policyd.policy.kinds.rendezvous import rendezvous_weight
from policyd.pool.pod import InFlight

from .helpers import pod, problems, request, router

HOME_ONLY = """
score:
  home:
    rendezvous: request.target_model
"""
PODS = [pod(f"vllm-{i}") for i in range(6)]
ADAPTERS = [f"adapter-{i}" for i in range(12)]


def home_of(key: str, names: list[str]) -> str:
    return max(names, key=lambda name: rendezvous_weight(key, name))


def test_the_weight_is_blake2b_of_key_and_pod_name_in_the_unit_interval() -> None:
    digest = hashlib.blake2b(b"adapter-3\x00vllm-0", digest_size=8).digest()
    assert rendezvous_weight("adapter-3", "vllm-0") == int.from_bytes(digest, "big") / 2**64
    weights = {rendezvous_weight(key, p.name) for key in ADAPTERS for p in PODS}
    assert len(weights) == len(ADAPTERS) * len(PODS)  # independent per pair
    assert all(0.0 <= w < 1.0 for w in weights)


def test_the_weight_is_the_same_in_another_process() -> None:
    # str hash() is salted per process; the homes must agree across policyd replicas.
    code = (
        "from policyd.policy.kinds.rendezvous import rendezvous_weight;"
        "print(repr(rendezvous_weight('adapter-3', 'vllm-0')))"
    )
    printed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert float(printed) == rendezvous_weight("adapter-3", "vllm-0")


def test_every_request_for_a_key_goes_to_its_home_whatever_the_pod_order(
    tmp_path: Path,
) -> None:
    route = router(tmp_path, HOME_ONLY)
    names = [p.name for p in PODS]
    homes = set()
    for adapter in ADAPTERS:
        forward = route.decide(request(adapter), PODS)
        backward = route.decide(request(adapter), PODS[::-1])
        assert forward.pod == backward.pod == home_of(adapter, names)
        homes.add(forward.pod)
    assert len(homes) >= 3  # twelve keys do not all share one home


def test_a_pod_leaving_moves_only_the_keys_it_was_home_to(tmp_path: Path) -> None:
    route = router(tmp_path, HOME_ONLY)
    before = {a: route.decide(request(a), PODS).pod for a in ADAPTERS}
    leaving = before["adapter-0"]
    remaining = [p for p in PODS if p.name != leaving]
    after = {a: route.decide(request(a), remaining).pod for a in ADAPTERS}
    for adapter in ADAPTERS:
        if before[adapter] != leaving:
            assert after[adapter] == before[adapter]
        else:
            assert after[adapter] == home_of(adapter, [p.name for p in remaining])


def test_load_overrides_the_home_once_it_outweighs_it(tmp_path: Path) -> None:
    route = router(
        tmp_path,
        """
        score:
          home:
            weight: 1
            rendezvous: request.target_model
          light load:
            weight: 2
            expr: 1.0 - double(pod.in_flight) / 10.0
        """,
    )
    home = home_of("adapter-1", [p.name for p in PODS])
    assert route.decide(request("adapter-1"), PODS).pod == home
    # 10 in flight costs the home all 2 points of load; the home is worth at most 1.
    loaded = [
        pod(p.name, address=p.address, load=InFlight(10 if p.name == home else 0)) for p in PODS
    ]
    decision = route.decide(request("adapter-1"), loaded)
    assert decision.outcome is Outcome.ROUTED
    assert decision.pod != home


def test_a_key_that_fails_scores_nothing_and_is_traced_for_every_pod(tmp_path: Path) -> None:
    route = router(
        tmp_path,
        """
        score:
          session home:
            weight: 5
            rendezvous: request.headers["x-session"]
          short queue:
            expr: 1.0 - double(pod.waiting_queue) / 10.0
        """,
    )
    pods = [pod("a", waiting_queue=5), pod("b", waiting_queue=1)]
    decision = route.decide(request("m"), pods)
    assert decision.pod == "b"  # the queue alone decides
    assert dict(decision.scores) == pytest.approx({"a": 0.5, "b": 0.9})
    (step,) = [t for t in decision.trace if t.kind == "score"]
    assert [name for name, _ in step.errors] == ["a", "b"]
    assert all(message.startswith("session home: ") for _, message in step.errors)
    with_session = route.decide(request("m", {"x-session": "s-1"}), pods)
    assert with_session.pod == home_of("s-1", ["a", "b"])  # 5 points of home beat 0.4 of queue


def test_an_empty_key_gives_no_home_so_base_model_requests_spread_on_load(
    tmp_path: Path,
) -> None:
    route = router(
        tmp_path,
        """
        score:
          adapter home:
            weight: 3
            rendezvous: 'request.target_model == pod.base_model ? "" : request.target_model'
          light load:
            weight: 1
            expr: 1.0 - double(pod.in_flight) / 10.0
        """,
    )
    pods = [pod(p.name, address=p.address, base_model="llama") for p in PODS]
    adapter = route.decide(request("adapter-1"), pods)
    assert adapter.pod == home_of("adapter-1", [p.name for p in PODS])
    picked = []
    for _ in range(12):  # each base-model request goes to the least loaded pod
        decision = route.decide(request("llama"), pods)
        picked.append(decision.pod)
        decision.chosen.load.count += 1
    assert sorted(picked) == sorted(p.name for p in PODS for _ in range(2))


@pytest.mark.parametrize(
    ("score", "expected"),
    [
        pytest.param(
            "  home:\n    rendezvous: request.max_tokens\n",
            "policy.yaml:3:17: the rendezvous key of scorer 'home' must be string, but this "
            "expression is int",
            id="key-not-a-string",
        ),
        pytest.param(
            "  home:\n    rendezvous: request.model\n    expr: 1\n",
            "policy.yaml:2:3: scorer 'home' has both 'expr' and 'rendezvous'; use one",
            id="both",
        ),
        pytest.param(
            "  home:\n    weight: 2\n",
            "policy.yaml:2:3: scorer 'home' needs one of: expr, rendezvous",
            id="neither",
        ),
    ],
)
def test_a_bad_rendezvous_scorer_is_a_load_error_at_its_place(
    tmp_path: Path, score: str, expected: str
) -> None:
    assert problems(tmp_path, "score:\n" + score) == [expected]
