"""``pod.prefix_match`` / ``pod.prefix_tokens``: laid over the candidates per request.

The router asks the request's ``PrefixMatcher`` only for a policy that reads a
prefix field, lays the answers over the pods for the filters and scorers, and
records the chosen pod's match and the best one on offer in the decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from policyd.fields.prefix_match import PrefixMatch
from policyd.policy import Outcome
from policyd.pool.pod import Pod

from .helpers import pod, request, router

PREFIX_SCORED = """
    name: prefix
    score:
      locality:
        weight: 1
        expr: pod.prefix_match
    pick:
      strategy: max-score
"""


class FakeMatcher:
    """Answers fixed matches by pod name, and counts how often it was asked."""

    def __init__(self, matches: dict[str, tuple[float, int]]) -> None:
        self.matches = matches
        self.asked: list[tuple[str, tuple[str, ...]]] = []

    def match(self, model: str, pods: Sequence[Any]) -> list[PrefixMatch]:
        self.asked.append((model, tuple(p.name for p in pods)))
        return [PrefixMatch(*self.matches.get(p.name, (0.0, 0))) for p in pods]


def pods() -> tuple[Pod, ...]:
    return tuple(pod(f"p{i}") for i in range(3))


def test_a_policy_reading_prefix_match_routes_to_the_best_match_and_says_so(
    tmp_path: Path,
) -> None:
    matcher = FakeMatcher({"p1": (0.25, 64), "p2": (0.75, 192)})
    decision = router(tmp_path, PREFIX_SCORED).decide(request("m"), pods(), matcher)
    assert (decision.outcome, decision.pod) == (Outcome.ROUTED, "p2")
    assert (decision.prefix_match, decision.best_prefix_match) == (0.75, 0.75)
    assert matcher.asked == [("m", ("p0", "p1", "p2"))]
    # The serving path counts the request against the snapshot's own pod.
    assert type(decision.chosen) is Pod and decision.chosen.name == "p2"


def test_filters_read_prefix_tokens_and_the_match_is_asked_for_the_target_model(
    tmp_path: Path,
) -> None:
    text = """
        name: warm
        models:
          m:
            targets: {adapter-1: 1}
        filters:
          warm only:
            keep: pod.prefix_tokens >= 100
    """
    matcher = FakeMatcher({"p0": (0.5, 128), "p2": (0.1, 16)})
    decision = router(tmp_path, text).decide(request("m"), pods(), matcher)
    assert decision.survivors == ("p0",)
    assert matcher.asked[0][0] == "adapter-1"
    assert (decision.prefix_match, decision.best_prefix_match) == (0.5, 0.5)


def test_the_chosen_pods_match_may_be_below_the_best_when_load_wins(tmp_path: Path) -> None:
    text = """
        name: balanced
        score:
          locality:
            weight: 1
            expr: pod.prefix_match
          short queue:
            weight: 2
            expr: 1.0 - double(pod.waiting_queue) / 10.0
        pick:
          strategy: max-score
    """
    candidates = (pod("busy", waiting_queue=10), pod("idle"))
    matcher = FakeMatcher({"busy": (0.9, 900)})
    decision = router(tmp_path, text).decide(request("m"), candidates, matcher)
    assert decision.pod == "idle"
    assert (decision.prefix_match, decision.best_prefix_match) == (0.0, 0.9)


def test_a_policy_that_reads_no_prefix_field_never_asks(tmp_path: Path) -> None:
    text = """
        name: queue
        score:
          short queue:
            weight: 1
            expr: 1.0 - double(pod.waiting_queue) / 10.0
        pick:
          strategy: max-score
    """
    matcher = FakeMatcher({"p0": (1.0, 1000)})
    decision = router(tmp_path, text).decide(request("m"), pods(), matcher)
    assert decision.outcome is Outcome.ROUTED
    assert matcher.asked == []
    assert decision.prefix_match is None and decision.best_prefix_match is None


def test_without_a_matcher_prefix_fields_read_zero(tmp_path: Path) -> None:
    text = """
        name: cold
        filters:
          warm only:
            keep: pod.prefix_match > 0.0
    """
    decision = router(tmp_path, text).decide(request("m"), pods())
    assert decision.outcome is Outcome.SHED


def test_a_walk_that_reads_prefix_fields_is_never_reused(tmp_path: Path) -> None:
    text = """
        name: warm
        filters:
          warm only:
            keep: pod.prefix_match >= 0.5
    """
    decide = router(tmp_path, text).decide
    candidates = pods()  # one tuple: a reusable walk would be keyed on it
    first = decide(request("m"), candidates, FakeMatcher({"p0": (0.5, 10)}))
    second = decide(request("m"), candidates, FakeMatcher({"p1": (0.5, 10)}))
    assert (first.survivors, second.survivors) == (("p0",), ("p1",))
