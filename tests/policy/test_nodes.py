"""Each filter-node kind, the walk semantics, and what a CEL error on a pod means."""

from __future__ import annotations

from pathlib import Path

import pytest

from policyd.cel import CelEvalError
from policyd.policy import Outcome
from policyd.policy.evaluation import Evaluation, PodExpression

from .helpers import pod, request, router

PODS = [
    pod("a", waiting_queue=0, kv_cache=0.9, labels={"zone": "x"}),
    pod("b", waiting_queue=4, kv_cache=0.1),
    pod("c", waiting_queue=9, kv_cache=0.5, labels={"zone": "y"}),
    pod("d", waiting_queue=2, kv_cache=0.3),
]


def test_keep_passes_the_pods_for_which_the_predicate_holds(tmp_path: Path) -> None:
    decision = router(
        tmp_path,
        """
        filters:
          short queue:
            keep: pod.waiting_queue < 3
        """,
    ).decide(request(), PODS)
    assert decision.survivors == ("a", "d")
    (trace,) = decision.trace
    assert (trace.node, trace.kind, trace.candidates_in, trace.kept) == (
        "short queue",
        "keep",
        4,
        ("a", "d"),
    )
    assert (trace.branch, trace.next) == ("on_success", "")


def test_on_success_gets_the_kept_pods_and_on_failure_gets_the_input(tmp_path: Path) -> None:
    text = """
        filters:
          first:
            keep: pod.waiting_queue > params.limit
            on_success: after success
            on_failure: after failure
          after success:
            keep: "true"
          after failure:
            keep: "true"
        params:
          limit: {type: int, value: %d}
        """
    succeeded = router(tmp_path, text % 3).decide(request(), PODS)
    assert [t.node for t in succeeded.trace] == ["first", "after success"]
    assert succeeded.trace[1].candidates_in == 2  # b and c
    assert succeeded.survivors == ("b", "c")
    failed = router(tmp_path, text % 100).decide(request(), PODS)
    assert [t.node for t in failed.trace] == ["first", "after failure"]
    assert failed.trace[0].branch == "on_failure"
    assert failed.trace[1].candidates_in == 4  # the input of "first", not its empty result
    assert failed.survivors == ("a", "b", "c", "d")


def test_next_follows_both_outcomes(tmp_path: Path) -> None:
    text = """
        filters:
          first:
            keep: pod.waiting_queue > %d
            next: last
          last:
            band: pod.kv_cache
        """
    assert router(tmp_path, text % 3).decide(request(), PODS).survivors == ("b",)
    failed = router(tmp_path, text % 100).decide(request(), PODS)
    assert [t.node for t in failed.trace] == ["first", "last"]
    assert failed.survivors == ("b", "d")  # least KV band over all four


def test_a_failing_node_without_on_failure_ends_the_walk_with_no_pods_429(
    tmp_path: Path,
) -> None:
    decision = router(
        tmp_path,
        """
        filters:
          impossible:
            keep: pod.waiting_queue > 1000
            on_success: never
          never:
            keep: "true"
        """,
    ).decide(request(), PODS)
    assert decision.outcome is Outcome.SHED
    assert decision.outcome.http_status == 429
    assert "impossible" in decision.reason
    assert decision.trace[0].kept == ()


def test_if_branches_on_the_request_and_filters_nothing(tmp_path: Path) -> None:
    text = """
        filters:
          premium:
            if: request.headers["x-tier"] == "gold"
            then: fastest
            else: any
          fastest:
            top_k: 1
            lowest: pod.waiting_queue
          any:
            keep: "true"
        """
    gold = router(tmp_path, text).decide(request(headers={"x-tier": "gold"}), PODS)
    assert gold.survivors == ("a",)
    assert (gold.trace[0].kind, gold.trace[0].branch, gold.trace[0].next) == (
        "if",
        "then",
        "fastest",
    )
    assert (gold.trace[0].candidates_in, gold.trace[0].kept) == (4, ())  # every pod goes on
    assert gold.trace[1].candidates_in == 4
    silver = router(tmp_path, text).decide(request(headers={"x-tier": "silver"}), PODS)
    assert silver.trace[0].branch == "else"
    assert silver.survivors == ("a", "b", "c", "d")


def test_an_if_error_takes_else_and_is_traced(tmp_path: Path) -> None:
    decision = router(
        tmp_path,
        """
        filters:
          tier:
            if: request.headers["x-tier"] == "gold"
            then: gold
            else: other
          gold:
            shed: gold path
          other:
            shed: other path
        """,
    ).decide(request(), PODS)  # no x-tier header: the map lookup fails
    assert decision.reason == "other path"
    assert decision.trace[0].branch == "else"
    assert decision.trace[0].note == "error"
    ((pod_name, message),) = decision.trace[0].errors
    assert pod_name == "" and "x-tier" in message


def test_band_keeps_min_to_min_plus_range_over_n(tmp_path: Path) -> None:
    # queues 0, 4, 9, 2: N = 4, limit 0 + 9 / 4 = 2.25 keeps 0 and 2
    decision = router(tmp_path, "filters:\n  b:\n    band: pod.waiting_queue\n").decide(
        request(), PODS
    )
    assert decision.survivors == ("a", "d")
    assert decision.trace[0].band == (0, 2.25)
    # kv 0.9, 0.1, 0.5, 0.3: limit 0.1 + 0.8 / 4 = 0.3 keeps 0.1 and 0.3
    decision = router(tmp_path, "filters:\n  b:\n    band: pod.kv_cache\n").decide(request(), PODS)
    assert decision.survivors == ("b", "d")


def test_band_n_is_the_number_of_pods_entering_the_node(tmp_path: Path) -> None:
    text = """
        filters:
          not c:
            keep: pod.name != "c"
            next: band
          band:
            band: pod.waiting_queue
        """
    # a, b, d enter: queues 0, 4, 2, limit 0 + 4 / 3 = 1.33 keeps only a
    decision = router(tmp_path, text).decide(request(), PODS)
    assert decision.trace[1].candidates_in == 3
    assert decision.survivors == ("a",)


def test_equal_values_all_stay_in_the_band(tmp_path: Path) -> None:
    pods = [pod(n, waiting_queue=7) for n in "xyz"]
    decision = router(tmp_path, "filters:\n  b:\n    band: pod.waiting_queue\n").decide(
        request(), pods
    )
    assert decision.survivors == ("x", "y", "z")


@pytest.mark.parametrize(
    ("end", "k", "expected"),
    [
        ("lowest", 2, ("a", "d")),
        ("highest", 2, ("b", "c")),
        ("lowest", 10, ("a", "b", "c", "d")),
    ],
)
def test_top_k_keeps_the_k_extreme_pods_in_candidate_order(
    tmp_path: Path, end: str, k: int, expected: tuple[str, ...]
) -> None:
    decision = router(
        tmp_path, f"filters:\n  top:\n    top_k: {k}\n    {end}: pod.waiting_queue\n"
    ).decide(request(), PODS)
    assert decision.survivors == expected
    assert decision.trace[0].kind == "top_k"


def test_top_k_ties_at_the_cut_go_to_the_earlier_candidate(tmp_path: Path) -> None:
    pods = [pod("p", kv_cache=0.5), pod("q", kv_cache=0.2), pod("r", kv_cache=0.2)]
    decision = router(tmp_path, "filters:\n  t:\n    top_k: 1\n    lowest: pod.kv_cache\n").decide(
        request(), pods
    )
    assert decision.survivors == ("q",)


def test_shed_answers_429_with_its_reason(tmp_path: Path) -> None:
    decision = router(
        tmp_path,
        """
        filters:
          sheddable?:
            if: request.criticality == "sheddable"
            then: shed it
          shed it:
            shed: sheddable traffic is off during the migration
        """,
    ).decide(request(headers={"x-gateway-inference-criticality": "sheddable"}), PODS)
    assert decision.outcome is Outcome.SHED
    assert decision.reason == "sheddable traffic is off during the migration"
    assert decision.trace[-1].kind == "shed"
    assert decision.endpoint == ""


ERRORING = """
filters:
  zone x:
    keep: pod.labels["zone"] == "x"
    %s
"""


def test_a_cel_error_drops_the_pod_by_default_and_the_trace_says_so(tmp_path: Path) -> None:
    decision = router(tmp_path, ERRORING % "").decide(request(), PODS)
    assert decision.survivors == ("a",)
    errored = dict(decision.trace[0].errors)
    assert set(errored) == {"b", "d"}  # no zone label: the lookup fails
    assert "zone" in errored["b"]


def test_on_error_pass_keeps_the_pod_and_still_traces_the_error(tmp_path: Path) -> None:
    decision = router(tmp_path, ERRORING % "on_error: pass").decide(request(), PODS)
    assert decision.survivors == ("a", "b", "d")
    assert {name for name, _ in decision.trace[0].errors} == {"b", "d"}


def test_band_errors_leave_min_and_max_and_follow_on_error(tmp_path: Path) -> None:
    text = """
        filters:
          b:
            band: 10 / (pod.waiting_queue - 4)
            %s
        """
    # b divides by zero; the others: a -2, c 2, d -5 -> limit -5 + 7 / 4 = -3.25 keeps d
    dropped = router(tmp_path, text % "").decide(request(), PODS)
    assert dropped.survivors == ("d",)
    assert [name for name, _ in dropped.trace[0].errors] == ["b"]
    passed = router(tmp_path, text % "on_error: pass").decide(request(), PODS)
    assert passed.survivors == ("b", "d")


def test_top_k_on_error_pass_keeps_the_failed_pods_besides_the_k(tmp_path: Path) -> None:
    text = "filters:\n  t:\n    top_k: 1\n    lowest: 10 / (pod.waiting_queue - 4)\n    %s\n"
    assert router(tmp_path, text % "").decide(request(), PODS).survivors == ("d",)
    assert router(tmp_path, text % "on_error: pass").decide(request(), PODS).survivors == (
        "b",
        "d",
    )


def test_variables_compose_and_a_failing_variable_is_named_in_the_error(
    tmp_path: Path,
) -> None:
    decision = router(
        tmp_path,
        """
        variables:
          zone: pod.labels["zone"]
          in_x: variables.zone == "x"
        filters:
          in zone x:
            keep: variables.in_x
        """,
    ).decide(request(), PODS)
    assert decision.survivors == ("a",)
    errors = dict(decision.trace[0].errors)
    assert errors.keys() == {"b", "d"}
    assert errors["b"].startswith("variables.zone: ")


def test_a_variable_is_evaluated_at_most_once_per_pod_across_nodes() -> None:
    calls: list[str] = []

    def slow_variable(activation: object) -> int:
        calls.append(activation["pod"].name)  # type: ignore[index]
        return 1

    needs = (("variables.v", slow_variable),)
    first = PodExpression("variables.v == 1", lambda act: act["variables.v"] == 1, needs)
    second = PodExpression("variables.v + 1", lambda act: act["variables.v"] + 1, needs)
    ev = Evaluation(request())
    assert first.select(PODS, ev, keep_failed=False)[0] == PODS
    assert second.values(PODS[:2], ev)[0] == [2, 2]
    assert calls == ["a", "b", "c", "d"]  # not again for a and b in the second node


def test_a_failed_variable_is_not_evaluated_again_for_the_same_pod() -> None:
    calls: list[str] = []

    def failing(activation: object) -> int:
        calls.append("x")
        raise CelEvalError("no such key: zone")

    expression = PodExpression(
        "variables.v", lambda act: act["variables.v"], (("variables.v", failing),)
    )
    ev = Evaluation(request())
    for _ in range(3):
        _, errors = expression.values(PODS[:1], ev)
        assert errors == [("a", "variables.v: no such key: zone")]
    assert calls == ["x"]


def test_a_walk_that_ends_at_an_if_keeps_its_input(tmp_path: Path) -> None:
    decision = router(
        tmp_path,
        """
        filters:
          critical only:
            if: request.criticality == "critical"
            then: shortest
          shortest:
            top_k: 1
            lowest: pod.waiting_queue
        """,
    ).decide(request(), PODS)
    assert decision.outcome is Outcome.ROUTED
    assert decision.survivors == ("a", "b", "c", "d")
    assert decision.trace[0].next == ""
