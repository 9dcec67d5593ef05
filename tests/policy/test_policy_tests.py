"""``policyd test``: the shipped rules pass, failures and broken files are reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from policyd.cli import main
from policyd.policy.loader import is_test_file, policy_files
from policyd.policy.testing import policy_tests_path

from .helpers import RULES, write


def run(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> tuple[int, list[str]]:
    code = main(["test", *args])
    return code, capsys.readouterr().out.replace(str(tmp_path) + "/", "").splitlines()


def test_every_shipped_policy_has_tests() -> None:
    policies = policy_files(RULES)
    assert {p.name for p in policies} >= {
        "default.yaml",
        "scorers.yaml",
        "random.yaml",
        "round-robin.yaml",
    }
    for policy in policies:
        assert policy_tests_path(policy).exists(), policy


def test_policyd_test_passes_over_all_of_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, lines = run(capsys, tmp_path, str(RULES), "--verbose")
    assert code == 0, lines
    test_files = [p for p in RULES.iterdir() if is_test_file(p)]
    assert len(test_files) >= 4
    passed = [line for line in lines if ": PASS " in line]
    assert len(passed) >= 20
    assert lines[-1] == f"{len(passed)} passed, 0 failed"


POLICY = """
filters:
  short queue:
    keep: pod.waiting_queue < 5
"""

TESTS = """
pods:
  a: {waiting_queue: 1}
  b: {waiting_queue: 9}
cases:
  the short queue wins:
    request: {model: m}
    expect: {pick: a, survivors: [a], path: [short queue]}
  wrong on purpose:
    request: {model: m}
    expect:
      pick: b
      survivors: [a, b]
      path: [other]
  busy pods are shed:
    request: {model: m}
    pods:
      c: {waiting_queue: 7}
    expect: {outcome: shed, reason: no pod passed}
  a wrong outcome:
    request: {model: m}
    pods: {}
    expect: {outcome: routed}
"""


def test_failing_cases_are_reported_at_their_line_with_every_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write(tmp_path, POLICY)
    write(tmp_path, TESTS, "policy.test.yaml")
    code, lines = run(capsys, tmp_path, str(policy))
    assert code == 1
    assert lines == [
        "policy.test.yaml:8:3: FAIL wrong on purpose: expected pick b, got a; "
        "expected survivors ['a', 'b'], got ['a']; expected path ['other'], got ['short queue']",
        "policy.test.yaml:19:3: FAIL a wrong outcome: expected outcome routed, got "
        "no-capacity (no ready pods)",
        "2 passed, 2 failed",
    ]


def test_a_broken_test_file_is_reported_with_positions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, POLICY)
    broken = write(
        tmp_path,
        """
        pods:
          a: {waiting_qeue: 1}
        cases:
          no expectation:
            request: {model: m}
          bad expectation:
            request: {model: m}
            expect: {outcome: maybe}
        """,
        "policy.test.yaml",
    )
    code, lines = run(capsys, tmp_path, str(broken))
    assert code == 1
    assert lines == [
        "policy.test.yaml:2:7: unknown field 'waiting_qeue' in a pod; "
        "did you mean 'waiting_queue'?",
        "policy.test.yaml:4:3: case 'no expectation' needs an 'expect'",
        "policy.test.yaml:8:23: 'outcome' must be one of routed, shed, no-capacity, "
        "unknown-model, error, held, not 'maybe'",
        "0 passed, 0 failed",
    ]


def test_a_policy_without_tests_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = write(tmp_path, POLICY)
    code, lines = run(capsys, tmp_path, str(policy))
    assert code == 1
    assert lines == ["policy.yaml: no tests: expected them in policy.test.yaml"]


def test_a_test_file_can_name_its_policy_and_check_a_traffic_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(
        tmp_path,
        """
        models:
          chat:
            criticality: critical
            targets: {chat-v2: 1}
        """,
        "split.yaml",
    )
    tests = write(
        tmp_path,
        """
        policy: split.yaml
        pods: {only: {}}
        cases:
          chat is rewritten and critical:
            request: {model: chat}
            expect: {target_model: chat-v2, criticality: critical, pick: only}
        """,
        "checks.test.yaml",
    )
    code, lines = run(capsys, tmp_path, str(tests))
    assert (code, lines) == (0, ["1 passed, 0 failed"])
