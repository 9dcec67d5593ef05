"""The ``flow`` section: read, type-checked, answering per request (``Router.admission``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from policyd.cli import main
from policyd.policy import Request
from policyd.policy.explain import explain, render_text, to_json

from .helpers import pod, policy_set, problems, router, write

FLOW = """
name: held
filters:
  all:
    keep: "true"
flow:
  saturated: pod.waiting_queue >= 5 || pod.in_flight >= 8
  bands:
    critical: {max_wait: 60s, max_requests: 10}
    standard: {max_wait: 20s}
    sheddable: {max_wait: 500ms}
  flows:
    key: request.headers["x-tenant"]
    default: anonymous
    weights: {gold: 3}
  order: deadline
  answer: {status: 503}
"""


def test_the_band_comes_from_the_criticality_the_policy_decided(tmp_path: Path) -> None:
    decide = router(tmp_path, FLOW)
    critical = decide.admission(
        Request("m", headers={"x-gateway-inference-criticality": "critical"})
    )
    plain = decide.admission(Request("m"))
    assert critical is not None and plain is not None
    assert (critical.band.name, critical.band.rank, critical.band.max_wait_s) == ("critical", 0, 60)
    assert critical.band.max_requests == 10
    assert (plain.band.name, plain.band.rank) == ("standard", 1)
    assert critical.flow.status == 503 and critical.policy == "held"


def test_the_flow_key_its_default_and_its_weight(tmp_path: Path) -> None:
    decide = router(tmp_path, FLOW)
    gold = decide.admission(Request("m", headers={"x-tenant": "gold"}))
    other = decide.admission(Request("m", headers={"x-tenant": "tin"}))
    nobody = decide.admission(Request("m"))
    assert gold is not None and other is not None and nobody is not None
    assert (gold.key, gold.weight) == ("gold", 3.0)
    assert (other.key, other.weight) == ("tin", 1.0)
    assert (nobody.key, nobody.weight) == ("anonymous", 1.0)


def test_without_a_key_the_fairness_id_header_names_the_flow_llm_ds_spelling_first(
    tmp_path: Path,
) -> None:
    decide = router(tmp_path, FLOW.replace('    key: request.headers["x-tenant"]\n', ""))
    new, old = "x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id"
    cases = {
        "gold": {new: "gold"},
        "tin": {old: "tin"},
        "both": {new: "both", old: "older"},
        "anonymous": {new: " ", "x-tenant": "gold"},  # blank, and a key the policy no longer names
    }
    for flow, headers in cases.items():
        admission = decide.admission(Request("m", headers=headers))
        assert admission is not None and admission.key == flow, headers
    keyed = router(tmp_path, FLOW, seed=0).admission(Request("m", headers={new: "gold"}))
    assert keyed is not None and keyed.key == "anonymous"  # a policy's own key wins


def test_a_deadline_header_orders_else_the_band_wait(tmp_path: Path) -> None:
    decide = router(tmp_path, FLOW)
    asked = decide.admission(Request("m", headers={"x-request-deadline-ms": "1500"}))
    plain = decide.admission(Request("m"))
    assert asked is not None and plain is not None
    assert asked.flow.deadline_of(asked.request, 100.0, asked.band) == 101.5
    assert plain.flow.deadline_of(plain.request, 100.0, plain.band) == 120.0


def test_room_is_the_pods_the_predicate_does_not_call_saturated(tmp_path: Path) -> None:
    decide = router(tmp_path, FLOW)
    admission = decide.admission(Request("m"))
    assert admission is not None
    busy, free, full = pod("busy", waiting_queue=5), pod("free", waiting_queue=4), pod("full")
    full.load.count = 8
    assert [p.name for p in admission.room([busy, free, full])] == ["free"]
    assert admission.room([busy, full]) == []


def test_a_priority_expression_names_the_band_and_an_unknown_name_is_the_lowest(
    tmp_path: Path,
) -> None:
    text = FLOW.replace("  order: deadline\n", '  priority: request.headers["x-band"]\n')
    decide = router(tmp_path, text)
    asked = decide.admission(Request("m", headers={"x-band": "critical"}))
    unknown = decide.admission(Request("m", headers={"x-band": "gold"}))
    missing = decide.admission(Request("m"))
    assert asked is not None and unknown is not None and missing is not None
    assert [a.band.name for a in (asked, unknown, missing)] == [
        "critical",
        "sheddable",
        "sheddable",
    ]


def test_a_policy_without_flow_admits_nothing(tmp_path: Path) -> None:
    text = FLOW[: FLOW.index("flow:")]
    assert router(tmp_path, text).admission(Request("m")) is None


def test_flow_expressions_are_type_checked_at_their_place(tmp_path: Path) -> None:
    text = (
        FLOW.replace("pod.waiting_queue >= 5 || pod.in_flight >= 8", "pod.waiting_queue")
        .replace('key: request.headers["x-tenant"]', "key: pod.name")
        .replace("  order: deadline\n", "  priority: 3\n")
    )
    found = problems(tmp_path, text)
    assert any(
        p.startswith("policy.yaml:6:14:") and "'saturated' must be bool" in p for p in found
    ), found
    assert any(p.startswith("policy.yaml:12:") and "before any pod" in p for p in found), found
    assert any("'priority' must be string" in p for p in found), found


def test_a_band_wait_over_envoys_maximum_is_refused(tmp_path: Path) -> None:
    found = problems(tmp_path, FLOW.replace("max_wait: 60s", "max_wait: 5m"))
    assert any("'max_wait' must be under" in p for p in found), found


def test_explain_says_a_request_would_be_held(tmp_path: Path) -> None:
    policies = policy_set(tmp_path, FLOW)
    full = [pod("a", waiting_queue=5), pod("b", waiting_queue=9)]
    explanation = explain(policies, Request("m", headers={"x-tenant": "gold"}), full)
    assert explanation.held.startswith("would be held: every pod is saturated")
    assert "band standard, flow gold, for up to 20s" in explanation.held
    assert "flow      would be held" in render_text(explanation)
    assert to_json(explanation)["held"] == explanation.held
    roomy = explain(policies, Request("m"), [pod("a"), *full])
    assert roomy.held == "" and to_json(roomy)["held"] is None


TESTS = """
policy: policy.yaml
pods:
  a: {waiting_queue: 5}
  b: {waiting_queue: 1}
cases:
  room on b:
    request: {model: m}
    expect: {pick: b}
  every pod saturated:
    request: {model: m}
    pods:
      a: {waiting_queue: 5}
    expect: {outcome: held}
  held, not routed:
    request: {model: m}
    pods:
      a: {waiting_queue: 5}
    expect: {outcome: routed}
"""


def test_policyd_test_can_expect_held(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = write(tmp_path, FLOW)
    write(tmp_path, TESTS, "policy.test.yaml")
    code = main(["test", str(policy)])
    lines = capsys.readouterr().out.replace(str(tmp_path) + "/", "").splitlines()
    assert code == 1
    assert lines[0].startswith(
        "policy.test.yaml:14:3: FAIL held, not routed: expected outcome routed, got would be held"
    ), lines
    assert lines[-1] == "2 passed, 1 failed"
