"""Compiling against the schema: load-time errors carry a position; evaluation works."""

from __future__ import annotations

import pytest
from cel_expr_python import cel

from policyd.cel import (
    CelCompileError,
    CelEvalError,
    Duration,
    Environment,
    pod_type,
    request_type,
)
from policyd.policy.request import Request
from policyd.pool.pod import Pod


@pytest.fixture(scope="module")
def environment() -> Environment:
    return Environment(
        {"pod": pod_type(), "request": request_type(), "params.queue_limit": cel.Type.INT}
    )


def test_seed_rule_keeps_the_pod_with_the_adapter_and_a_short_queue(
    environment: Environment,
) -> None:
    program = environment.compile(
        "pod.waiting_queue < params.queue_limit && request.model in pod.active_loras",
        constants={"params.queue_limit": 50},
    )
    request = Request(model="sql-lora")
    assert program.return_type == "BOOL"
    keep = Pod("a", "1.1.1.1:80", waiting_queue=3, active_loras=("sql-lora",))
    busy = Pod("b", "1.1.1.2:80", waiting_queue=60, active_loras=("sql-lora",))
    cold = Pod("c", "1.1.1.3:80", waiting_queue=0)
    results = [program.evaluate({"pod": p, "request": request}) for p in (keep, busy, cold)]
    assert results == [True, False, False]


@pytest.mark.parametrize(
    ("source", "column", "fragment"),
    [
        ("pod.waiting_qeue < 3", 4, "undefined field 'waiting_qeue'"),
        ("pod.kv_cache > 'x'", 14, "no matching overload"),
        ("nope == 1", 1, "undeclared reference to 'nope'"),
        ("pod.running +", 14, "Syntax error"),
    ],
)
def test_load_time_errors_name_the_column(
    environment: Environment, source: str, column: int, fragment: str
) -> None:
    with pytest.raises(CelCompileError) as error:
        environment.compile(source)
    assert error.value.line == 1
    assert error.value.column == column
    assert fragment in error.value.message


def test_runtime_errors_are_cel_errors_and_or_absorbs_them(environment: Environment) -> None:
    pod = Pod("a", "1.1.1.1:80", labels={"zone": "a"}, metrics_age=Duration.from_seconds(0.25))
    failing = environment.compile("pod.labels['region'] == 'x'")
    with pytest.raises(CelEvalError, match="region"):
        failing.evaluate({"pod": pod})
    absorbed = environment.compile("pod.labels['region'] == 'x' || pod.labels.zone == 'a'")
    assert absorbed.evaluate({"pod": pod}) is True
    age = environment.compile("pod.metrics_age < duration('300ms')")
    assert age.evaluate({"pod": pod}) is True


@pytest.mark.parametrize(
    ("source", "reads"),
    [
        (
            "pod.waiting_queue < params.queue_limit && request.model in pod.active_loras",
            {
                "pod",
                "request",
                "params.queue_limit",
                "pod.waiting_queue",
                "pod.active_loras",
                "request.model",
            },
        ),
        # a loop variable named like a field is not a read of the schema object
        ("pod.active_loras.exists(model, model == 'x')", {"pod", "pod.active_loras"}),
        # the object used whole may read any field
        ("dyn(pod) != null", {"pod", "pod.*"}),
        ("1 + 2 == 3", set()),
    ],
)
def test_a_program_says_what_it_reads(
    environment: Environment, source: str, reads: set[str]
) -> None:
    program = environment.compile(source, constants={"params.queue_limit": 50})
    assert program.reads == frozenset(reads)


def test_a_program_s_value_type_declares_a_variable_that_holds_it(
    environment: Environment,
) -> None:
    program = environment.compile("pod.active_loras")
    holder = Environment({"variables.loras": program.value_type})
    assert holder.compile("variables.loras.size() > 0").return_type == "BOOL"
    with pytest.raises(CelCompileError):
        holder.compile("variables.loras + 1")
