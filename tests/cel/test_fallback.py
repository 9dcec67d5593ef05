"""What the compiler does not lower runs through cel-expr-python, and says so."""

from __future__ import annotations

import pytest
from cel_expr_python import cel

from policyd.cel import CelEvalError, Duration, Environment, UInt, pod_type
from policyd.pool.pod import Pod

ENVIRONMENT = Environment({"pod": pod_type(), "u": cel.Type.UINT, "dy": cel.Type.DYN})
POD = Pod("vllm-0", "10.0.0.1:8000", labels={"zone": "a"}, metrics_age=Duration(1))


def test_message_construction_falls_back_and_the_report_says_why() -> None:
    program = ENVIRONMENT.compile("policyd.Pod{name: 'vllm-0'}.name == pod.name")
    assert program.lowered is False
    assert program.python_source is None
    assert "constructing message 'policyd.Pod'" in program.report[0]
    assert any("cel-expr-python" in line for line in program.report)
    assert program.evaluate({"pod": POD}) is True


def test_fallback_errors_are_cel_errors() -> None:
    program = ENVIRONMENT.compile("policyd.Pod{name: 'x'}.name == pod.labels['region']")
    with pytest.raises(CelEvalError, match="region"):
        program.evaluate({"pod": POD})
    with pytest.raises(CelEvalError):
        program.evaluate({"pod": object()})


def test_fallback_keeps_uints_and_nanoseconds_of_its_inputs() -> None:
    program = ENVIRONMENT.compile(
        "google.protobuf.Int64Value{value: 1} == 1 ? [u + 1u, dy, pod.metrics_age] : []"
    )
    assert program.lowered is False
    result = program.evaluate({"pod": POD, "u": UInt(2), "dy": UInt(5)})
    assert result[:2] == [3, 5]
    assert all(isinstance(item, UInt) for item in result[:2])
    exact = ENVIRONMENT.compile(
        "google.protobuf.Int64Value{value: 1} == 1 && pod.metrics_age == duration('1ns')"
    )
    assert exact.lowered is False
    assert exact.evaluate({"pod": POD}) is True  # the 1 ns input reached cel-cpp whole


def test_fallback_reports_that_returned_durations_lose_nanoseconds() -> None:
    program = ENVIRONMENT.compile(
        "google.protobuf.Int64Value{value: 1} == 1 ? pod.metrics_age : duration('0s')"
    )
    assert any("rounded to microseconds" in line for line in program.report)
    assert program.evaluate({"pod": POD}) == Duration(0)  # 1 ns, rounded by the bridge
    assert ENVIRONMENT.compile("pod.metrics_age").evaluate({"pod": POD}) == Duration(1)


def nested_exists(depth: int) -> str:
    return "".join(f"[1].exists(v{i}, " for i in range(depth)) + "true" + ")" * depth


def test_nesting_beyond_what_python_compiles_falls_back_with_the_reason() -> None:
    program = ENVIRONMENT.compile(nested_exists(8))
    assert program.lowered is False
    assert "too many statically nested blocks" in program.report[0]
    assert program.evaluate({}) is True
    assert ENVIRONMENT.compile(nested_exists(4)).lowered is True
