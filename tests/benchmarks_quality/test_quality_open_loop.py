"""The open-loop side of benchmarks/quality.py: prompts reach the router, both prefix modes learn.

Not quality claims (the benchmark makes those): these check that a policy
reading ``pod.prefix_match`` gets it from the right source in each mode, that
the knee is found as documented, and that the goals are judged as stated.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import pytest
from test_quality_wiring import REPO, quality

from policyd.prefix.index import ApproximateIndex, PreciseIndex
from policyd.sim.experiment import PodView
from policyd.sim.open_loop import Arrival, OpenRequest, PoolTruth, Turn, run_open_loop
from policyd.sim.profile import PROFILES
from policyd.sim.workloads import SharedPrefix

BASE = quality.PROFILE.base_model
TINY = SharedPrefix(groups=6, system_tokens=400, question_tokens=(20, 60), output_tokens=20)
# Pods whose cache holds a few of TINY's system prompts (25 blocks each), not all six.
SMALL_CACHE = quality.PROFILE.with_changes(num_gpu_blocks=120)
VIEWS = [PodView(i, f"vllm-{i}", 0, 0, 0.0, (), (), 4, 0.0, 0) for i in range(3)]
PROMPT = tuple(range(5000, 5100))  # 6 full blocks of 16


def _arrival(index: int, prompt: tuple[int, ...] = PROMPT) -> Arrival:
    truth = PoolTruth([], quality.PROFILE.block_size)
    return Arrival(index, BASE, (Turn(None, token_ids=prompt),), prompt, 10, 0.0, truth, ())


@pytest.fixture
def prefix_only(tmp_path: Path) -> Path:
    """A policy that goes where the prompt is cached; ties to the lowest in-flight count."""
    policy = tmp_path / "prefix-only.yaml"
    policy.write_text(
        "score:\n"
        "  prefix:\n    weight: 10\n    expr: pod.prefix_match\n"
        "  light:\n    expr: 1.0 - double(pod.in_flight) / 100.0\n"
        "pick:\n  strategy: max-score\n"
    )
    return policy


def test_approximate_mode_learns_where_this_router_sent_a_prompt(prefix_only: Path) -> None:
    route = quality.OpenPolicyRouting(prefix_only, seed=0, mode=quality.APPROXIMATE)
    assert isinstance(route.locator.index, ApproximateIndex)
    busy = [PodView(i, f"vllm-{i}", 0, 0, 0.0, (), (), 4, 0.0, [3, 0, 5][i]) for i in range(3)]
    first = route(_arrival(0), busy, random.Random(0))
    assert first == 1  # nothing cached anywhere: the least loaded
    idle_elsewhere = [
        PodView(i, f"vllm-{i}", 0, 0, 0.0, (), (), 4, 0.0, [0, 4, 0][i]) for i in range(3)
    ]
    assert route(_arrival(1), idle_elsewhere, random.Random(0)) == 1  # where it was sent
    other = tuple(range(9000, 9100))
    assert route(_arrival(2, other), idle_elsewhere, random.Random(0)) == 0


def test_precise_mode_learns_only_from_the_pods_kv_events(prefix_only: Path) -> None:
    route = quality.OpenPolicyRouting(prefix_only, seed=0, mode=quality.PRECISE)
    index = route.locator.index
    assert isinstance(index, PreciseIndex)
    loaded = [PodView(i, f"vllm-{i}", 0, 0, 0.0, (), (), 4, 0.0, [0, 1, 2][i]) for i in range(3)]
    assert route(_arrival(0), loaded, random.Random(0)) == 0
    assert route(_arrival(1), loaded, random.Random(0)) == 0  # routing taught it nothing
    assert index.blocks(quality.pod_address(0)) == 0
    # Pod 2 serves the prompt; its events reach the index through encode/decode.
    requests = [OpenRequest(0.0, None, _arrival(0).turns, PROMPT, 5, 5)]
    run_open_loop(lambda a, p, r: 2, requests, pods=3, kv_events=route.kv_events)
    assert index.blocks(quality.pod_address(2)) == 6
    assert route(_arrival(2), loaded, random.Random(0)) == 2


def test_precise_mode_matches_the_oracle_on_a_small_shared_prefix_run(prefix_only: Path) -> None:
    requests = TINY.requests(rate=3.0, duration_s=20.0, seed=2)

    def run(route: Any) -> float:  # an OpenPolicyRouting, or None for the oracle
        if route is None:
            return run_open_loop(
                quality.Oracle(), requests, pods=4, profile=SMALL_CACHE, seed=2
            ).hit_rate
        sink = route.kv_events if route.locator is not None else None
        result = run_open_loop(route, requests, pods=4, profile=SMALL_CACHE, seed=2, kv_events=sink)
        assert route.decisions == len(requests)
        return result.hit_rate

    precise = run(quality.OpenPolicyRouting(prefix_only, seed=2, mode=quality.PRECISE))
    blind = run(quality.OpenPolicyRouting(REPO / "rules" / "random.yaml", seed=2))
    oracle = run(None)
    assert precise > blind + 0.2
    assert precise >= 0.9 * oracle


def test_the_knee_is_the_first_rate_where_randoms_p90_doubles() -> None:
    assert quality.find_knee({1.0: 0.4, 2.0: 0.7, 3.0: 0.81, 4.0: 5.0}) == 3.0
    assert quality.find_knee({3.0: 0.81, 1.0: 0.4}) == 3.0  # order does not matter
    assert quality.find_knee({1.0: 0.4, 2.0: 0.5}) == 2.0  # never: the highest rate


def _figures(
    *, tokens: float, p90: float, hits: float, completed: float = 100, imbalance: float = 1.1
) -> Any:  # an OpenFigures
    return quality.OpenFigures(
        sent=[100],
        completed=[completed],
        tokens_per_s=[tokens],
        ttft_p50=[0.1],
        ttft_p90=[p90],
        ttft_p99=[p90],
        hit_rate=[hits],
        imbalance=[imbalance],
    )


def test_the_goals_are_judged_with_their_numbers() -> None:
    contenders = [
        quality.Contender("random", Path("random.yaml")),
        quality.Contender("p approx", Path("p.yaml"), quality.APPROXIMATE),
        quality.Contender("p precise", Path("p.yaml"), quality.PRECISE),
        quality.Contender("oracle", None),
    ]
    at = {
        "random": _figures(tokens=100, p90=5.0, hits=0.2),
        "p approx": _figures(tokens=100, p90=0.4, hits=0.76, imbalance=1.4),
        "p precise": _figures(tokens=101, p90=0.6, hits=0.78),
        "oracle": _figures(tokens=101, p90=0.4, hits=0.8),
    }
    lines = quality.open_goals("shared-prefix", contenders, {1.0: at, 1.5: at}, 1.0, None)
    text = "\n".join(lines)
    assert "p approx: hit rate 76.0% = 95.0% of the oracle's 80.0% (goal >= 95%): met" in text
    assert "p precise: hit rate 78.0% = 97.5% of the oracle's 80.0% (goal >= 98%): MISSED" in text
    assert "p approx: TTFT p90 0.40 s, 12.5x lower than random's 5.00 s (goal >= 10x): met" in text
    assert "p precise: TTFT p90 0.60 s, 8.3x lower" in text and "(goal >= 10x): MISSED" in text
    assert "p approx: max/mean load 1.40 (goal <= 1.3): MISSED" in text
    # At the knee equal throughput meets the goal; past it (random overloaded) it must be higher.
    knee, past = text.split("at 1.5x the knee")
    assert "p approx: 100 output tok/s vs random's 100 (1.00x; goal at least" in knee
    assert "p approx: 100 output tok/s vs random's 100 (1.00x; goal higher" in past
    assert past.count("goal higher, random is overloaded): MISSED") == 1


def test_on_mixed_the_combined_policy_is_held_to_lora_balanceds_completions_in_both_modes() -> None:
    combined = Path("combined.yaml")
    contenders = [
        quality.Contender("random", Path("random.yaml")),
        quality.Contender("lora-balanced", Path("lora-balanced.yaml")),
        quality.Contender("combined approx", combined, quality.APPROXIMATE),
        quality.Contender("combined precise", combined, quality.PRECISE),
        quality.Contender("oracle", None),
    ]
    at = {
        "random": _figures(tokens=100, p90=5.0, hits=0.2),
        "lora-balanced": _figures(tokens=100, p90=1.0, hits=0.4, completed=200),
        "combined approx": _figures(tokens=100, p90=0.4, hits=0.7, completed=198),
        "combined precise": _figures(tokens=100, p90=0.4, hits=0.7, completed=197),
        "oracle": _figures(tokens=100, p90=0.4, hits=0.8),
    }
    text = "\n".join(quality.open_goals("mixed", contenders, {1.0: at, 1.5: at}, 1.0, combined))
    assert text.count("combined approx: completed 198 vs lora-balanced's 200 (99.0%") == 2
    assert text.count("combined precise: completed 197 vs lora-balanced's 200 (98.5%") == 2
    assert text.count("98.5%; goal >= 99%): MISSED") == 2  # 198 of 200 meets 99%
    assert "hit rate" not in text  # locality goals belong to shared-prefix and multi-turn


def test_each_replica_counts_and_learns_only_its_own_routes(prefix_only: Path) -> None:
    replicas = [
        quality.OpenPolicyRouting(prefix_only, seed=i, mode=quality.APPROXIMATE) for i in (0, 1)
    ]
    route = quality.ReplicatedRouting(replicas)
    # The proxy's view says pod 0 is busy; each replica sees only its own counts instead.
    views = [PodView(i, f"vllm-{i}", 0, 0, 0.0, (), (), 4, 0.0, [9, 0, 0][i]) for i in range(3)]
    first = route(_arrival(0), views, random.Random(0))  # replica 0: a tie, its own draw
    second = route(_arrival(1), views, random.Random(0))  # replica 1
    address = quality.pod_address(first)
    assert replicas[0].locator.index.blocks(address) == 6
    assert second != first  # (these seeds) so replica 1 did not learn replica 0's route:
    assert replicas[1].locator.index.blocks(address) == 0
    assert route(_arrival(2), views, random.Random(0)) == first  # replica 0 learned it
    expected = [[0, 0, 0], [0, 0, 0]]
    expected[0][first] += 2
    expected[1][second] += 1
    assert route.counts == expected
    route.done(0)
    route.done(1)
    expected[0][first] -= 1
    expected[1][second] -= 1
    assert route.counts == expected


def test_two_approximate_replicas_serve_a_run_with_their_counts_back_to_zero(
    prefix_only: Path,
) -> None:
    contender = quality.Contender("x2", prefix_only, quality.APPROXIMATE, replicas=2)
    tiny = quality.OpenWorkload("tiny", TINY, {quality.PROFILE.name: (3.0,)})
    result = quality.run_contender(contender, tiny, rate=3.0, duration_s=10.0, seed=1)
    assert result.completed == result.sent > 20
    assert result.hit_rate > 0.5


def test_the_tokenizer_flag_changes_approximate_mode_only(prefix_only: Path) -> None:
    tiny = quality.OpenWorkload("tiny", TINY, {quality.PROFILE.name: (3.0,)})

    def hits(mode: str, tokenizer: str) -> float:
        contender = quality.Contender(mode, prefix_only, mode)
        run = quality.run_contender(
            contender, tiny, rate=3.0, duration_s=10.0, seed=4, tokenizer=tokenizer
        )
        return float(run.hit_rate)

    # Precise mode with estimated ids would match nothing the pods announce.
    assert hits(quality.PRECISE, "estimate") == hits(quality.PRECISE, "sim") > 0.5
    assert hits(quality.APPROXIMATE, "estimate") > 0.5  # equal text, equal pseudo-ids


def test_every_open_workload_sweeps_rates_on_every_profile() -> None:
    for workload in quality.OPEN_WORKLOADS.values():
        assert set(workload.rates) == set(PROFILES), workload.name
        for rates in workload.rates.values():
            assert list(rates) == sorted(set(rates)) and rates[0] > 0


def test_replicas_run_both_prefix_policies_in_both_modes_at_each_count(tmp_path: Path) -> None:
    prefix, combined = tmp_path / "p.yaml", tmp_path / "c.yaml"
    prefix.write_text("x"), combined.write_text("x")
    arguments = argparse.Namespace(
        prefix_policy=prefix, combined_policy=combined, replicas=[1, 2, 3], policy=[]
    )
    replicated = [
        (c.name, c.policy, c.mode, c.replicas)
        for c in quality.open_contenders(arguments)
        if c.replicas > 1
    ]
    assert replicated == [
        ("p approx x2", prefix, quality.APPROXIMATE, 2),
        ("p precise x2", prefix, quality.PRECISE, 2),
        ("c approx x2", combined, quality.APPROXIMATE, 2),
        ("c precise x2", combined, quality.PRECISE, 2),
        ("p approx x3", prefix, quality.APPROXIMATE, 3),
        ("p precise x3", prefix, quality.PRECISE, 3),
        ("c approx x3", combined, quality.APPROXIMATE, 3),
        ("c precise x3", combined, quality.PRECISE, 3),
    ]
    arguments.replicas = [1]
    assert all(c.replicas == 1 for c in quality.open_contenders(arguments))


def test_the_replica_goal_compares_with_one_replica_of_the_same_policy_and_mode() -> None:
    contenders = [
        quality.Contender("p approx", Path("p.yaml"), quality.APPROXIMATE),
        quality.Contender("p precise", Path("p.yaml"), quality.PRECISE),
        quality.Contender("p approx x2", Path("p.yaml"), quality.APPROXIMATE, 2),
        quality.Contender("p precise x2", Path("p.yaml"), quality.PRECISE, 2),
    ]
    at = {
        "p approx": _figures(tokens=100, p90=0.40, hits=0.80),
        "p precise": _figures(tokens=100, p90=0.50, hits=0.80),
        "p approx x2": _figures(tokens=100, p90=0.41, hits=0.60),
        "p precise x2": _figures(tokens=100, p90=0.52, hits=0.79),
    }
    lines = quality.replica_goals(contenders, {1.0: at, 1.5: at}, 1.0)
    assert len(lines) == 4  # two replicated contenders at the knee and at 1.5x it
    approximate = next(line for line in lines if "p approx x2 vs p approx" in line)
    assert "hit rate 60.0% vs 80.0% (0.750x)" in approximate and approximate.endswith("MISSED")
    precise = next(line for line in lines if "p precise x2 vs p precise" in line)
    assert "(0.988x), TTFT p90 0.52 s vs 0.50 s (1.040x;" in precise
    assert precise.endswith(": met")
