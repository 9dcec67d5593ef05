"""Scorers (weights, clamping, errors), every picker, and fallbacks."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest

from policyd.policy import Outcome
from policyd.policy.evaluation import Evaluation, PodExpression
from policyd.policy.kinds.max_score import MaxScore
from policyd.policy.kinds.round_robin import RoundRobin
from policyd.policy.kinds.uniform_random import UniformRandom
from policyd.policy.kinds.weighted_random import WeightedRandom
from policyd.policy.scoring import Scorer, clamp, score

from .helpers import pod, request, router

PODS = [
    pod("a", waiting_queue=0, kv_cache=0.9),
    pod("b", waiting_queue=4, kv_cache=0.1),
    pod("c", waiting_queue=9, kv_cache=0.5),
]


@pytest.mark.parametrize(
    ("raw", "clamped"),
    [(-3, 0.0), (0, 0.0), (0.25, 0.25), (1, 1.0), (7.5, 1.0), (True, 1.0), (False, 0.0)],
)
def test_clamp_keeps_scores_in_the_unit_interval(raw: float, clamped: float) -> None:
    assert clamp(raw) == clamped


def test_nan_scores_nothing() -> None:
    assert clamp(float("nan")) == 0.0


@pytest.mark.parametrize("raw", [-3, 0, 0.25, 1, 7.5, True, False, math.nan, math.inf, -math.inf])
def test_the_router_totals_add_each_value_as_clamp_gives_it(raw: float) -> None:
    """``score`` inlines ``clamp`` on the hot path; the two must not drift apart."""
    scorer = Scorer("s", 2.0, PodExpression("raw", lambda _activation: raw, ()))
    totals, errors = score([scorer], [pod("a")], Evaluation(request()))
    assert (totals, errors) == ([2.0 * clamp(raw)], [])


def test_total_is_the_weighted_sum_of_clamped_scores(tmp_path: Path) -> None:
    decision = router(
        tmp_path,
        """
        score:
          raw queue:           # 0, 4 and 9: clamped to 0, 1, 1
            weight: 2
            expr: pod.waiting_queue
          free kv:
            weight: 0.5
            expr: 1.0 - pod.kv_cache
          negative:            # always clamped to 0
            weight: 100
            expr: -1
        """,
    ).decide(request(), PODS)
    totals = dict(decision.scores)
    assert totals["a"] == pytest.approx(0.05)
    assert totals["b"] == pytest.approx(2.45)
    assert totals["c"] == pytest.approx(2.25)
    assert decision.pod == "b"
    assert decision.score == pytest.approx(2.45)
    assert [name for name, _ in decision.scores] == ["b", "c", "a"]  # best first
    assert decision.chosen is PODS[1]  # the candidate object itself, for in-flight counting


def test_a_scorer_error_adds_nothing_for_that_pod_and_is_traced(tmp_path: Path) -> None:
    decision = router(
        tmp_path,
        """
        score:
          zone:
            expr: pod.labels["zone"] == "x"
          queue:
            expr: 1.0 - double(pod.waiting_queue) / 10.0
        """,
    ).decide(request(), [pod("a", labels={"zone": "x"}, waiting_queue=5), pod("b")])
    totals = dict(decision.scores)
    assert totals == {"a": pytest.approx(1.5), "b": pytest.approx(1.0)}
    score_trace = decision.trace[-1]
    assert score_trace.kind == "score"
    ((name, message),) = score_trace.errors
    assert name == "b" and message.startswith("zone: ")


def test_max_score_breaks_ties_at_random() -> None:
    picker = MaxScore()
    rng = random.Random(3)
    picks = Counter(picker.pick([0.5, 0.9, 0.9, 0.1], 4, 0, rng)[0] for _ in range(2000))
    assert set(picks) == {1, 2}
    assert 800 < picks[1] < 1200


def test_max_score_fallbacks_are_the_next_best() -> None:
    assert MaxScore().pick([0.5, 0.9, 0.7, 0.1], 4, 2, random.Random(0)) == [1, 2, 0]


def test_weighted_random_follows_the_scores_with_a_seeded_rng() -> None:
    picker = WeightedRandom()
    rng = random.Random(11)
    draws = 20_000
    picks = Counter(picker.pick([1.0, 3.0, 0.0, 4.0], 4, 0, rng)[0] for _ in range(draws))
    assert picks[2] == 0
    for index, share in ((0, 1 / 8), (1, 3 / 8), (3, 4 / 8)):
        assert picks[index] / draws == pytest.approx(share, abs=0.015)


def test_weighted_random_with_all_zero_scores_is_uniform() -> None:
    rng = random.Random(5)
    picks = Counter(WeightedRandom().pick([0.0, 0.0], 2, 0, rng)[0] for _ in range(2000))
    assert 900 < picks[0] < 1100


def test_weighted_random_fallbacks_are_distinct_and_never_chosen_twice() -> None:
    rng = random.Random(2)
    for _ in range(200):
        chosen = WeightedRandom().pick([1.0, 2.0, 0.0, 3.0], 4, 3, rng)
        assert sorted(chosen) == [0, 1, 2, 3]
        assert chosen[-1] == 2  # the zero-score pod only once nothing else is left


def test_round_robin_takes_each_pod_in_turn_evenly() -> None:
    picker = RoundRobin()
    rng = random.Random(0)
    picks = [picker.pick(None, 5, 0, rng)[0] for _ in range(50)]
    assert picks[:6] == [0, 1, 2, 3, 4, 0]
    assert Counter(picks) == {i: 10 for i in range(5)}
    assert picker.pick(None, 5, 2, rng) == [0, 1, 2]


def test_uniform_random_is_uniform_with_distinct_fallbacks() -> None:
    rng = random.Random(9)
    picks = Counter(UniformRandom().pick(None, 4, 0, rng)[0] for _ in range(8000))
    for index in range(4):
        assert picks[index] == pytest.approx(2000, abs=150)
    for _ in range(100):
        chosen = UniformRandom().pick(None, 4, 2, rng)
        assert len(set(chosen)) == 3


@pytest.mark.parametrize("strategy", ["max-score", "weighted-random", "round-robin", "random"])
def test_fallbacks_are_other_survivors_and_at_most_what_exists(
    tmp_path: Path, strategy: str
) -> None:
    text = f"""
        score:
          queue: {{expr: "1.0 - double(pod.waiting_queue) / 10.0"}}
        pick:
          strategy: {strategy}
          fallbacks: %d
        """
    decision = router(tmp_path, text % 2).decide(request(), PODS)
    assert decision.outcome is Outcome.ROUTED
    assert len(decision.fallbacks) == 2
    assert decision.endpoint not in decision.fallbacks
    addresses = {p.address for p in PODS}
    assert {decision.endpoint, *decision.fallbacks} == addresses
    lonely = router(tmp_path, text % 5).decide(request(), PODS[:1])
    assert lonely.fallbacks == ()


def test_max_score_decision_returns_fallbacks_best_first(tmp_path: Path) -> None:
    decision = router(
        tmp_path,
        """
        score:
          short queue:
            expr: 1.0 - double(pod.waiting_queue) / 10.0
        pick: {strategy: max-score, fallbacks: 2}
        """,
    ).decide(request(), PODS)
    by_address = {p.address: p.name for p in PODS}
    assert decision.pod == "a"
    assert [by_address[f] for f in decision.fallbacks] == ["b", "c"]


def test_round_robin_through_the_router_is_fair_over_the_survivors(tmp_path: Path) -> None:
    rr = router(tmp_path, "pick: {strategy: round-robin}\n")
    picks = Counter(rr.decide(request(), PODS).pod for _ in range(300))
    assert picks == {"a": 100, "b": 100, "c": 100}


def test_pick_defaults_to_max_score_with_scorers_and_random_without(tmp_path: Path) -> None:
    scored = router(tmp_path, "score:\n  q: {expr: 'pod.waiting_queue == 4'}\n")
    assert scored.store.current.policies[0].picker.name == "max-score"
    assert scored.decide(request(), PODS).pod == "b"
    plain = router(tmp_path, "match: {models: ['*']}\n")
    assert plain.store.current.policies[0].picker.name == "random"
    assert plain.decide(request(), PODS).scores == ()
