"""Attack: a rule whose string work grows with the request's sizes, not with its step count.

A map over a 5,000-element literal concatenating a 60 KB header passes the
step bound (each concatenation is one step) yet builds 600 MB per evaluation.
Every string operation now counts the characters it builds or scans: what is
known at load time is refused at load, the rest stops the evaluation at the
budget with a ``CelEvalError``.
"""

from __future__ import annotations

import tracemalloc

import pytest

from policyd.cel import CelCompileError, CelEvalError, Environment, pod_type, request_type
from policyd.policy.request import Request

ENVIRONMENT = Environment({"pod": pod_type(), "request": request_type()})
FIVE_THOUSAND = "[" + ", ".join(str(i) for i in range(5000)) + "]"
# The budget (1 Mi characters) and one operation's copies fit well inside it.
MEMORY_CEILING = 8 * 1024 * 1024
BIG_HEADER = Request(model="m", headers={"x-big": "a" * 60_000})


def peak_bytes_of(evaluate: object) -> tuple[BaseException | None, int]:
    """The exception ``evaluate()`` raised (or None) and the peak bytes it allocated."""
    tracemalloc.start()
    try:
        evaluate()  # type: ignore[operator]
    except Exception as error:
        return error, tracemalloc.get_traced_memory()[1]
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return None, peak


def test_the_reviewed_header_concatenation_stops_at_the_budget_and_stays_small() -> None:
    program = ENVIRONMENT.compile(
        f'{FIVE_THOUSAND}.map(i, request.headers["x-big"] + request.headers["x-big"]).size() > 0'
    )
    error, peak = peak_bytes_of(lambda: program.evaluate({"request": BIG_HEADER, "pod": None}))
    assert isinstance(error, CelEvalError)
    assert "cost budget" in str(error)
    assert peak < MEMORY_CEILING  # 600 MB without the budget


def test_searching_a_big_header_thousands_of_times_stops_at_the_budget() -> None:
    program = ENVIRONMENT.compile(
        f'{FIVE_THOUSAND}.exists(i, request.headers["x-big"].contains("needle"))'
    )
    with pytest.raises(CelEvalError, match="cost budget"):
        program.evaluate({"request": BIG_HEADER, "pod": None})


def test_a_regex_run_over_a_big_header_per_element_stops_at_the_budget() -> None:
    program = ENVIRONMENT.compile(
        f'{FIVE_THOUSAND}.exists(i, request.headers["x-big"].matches("z$"))'
    )
    with pytest.raises(CelEvalError, match="cost budget"):
        program.evaluate({"request": BIG_HEADER, "pod": None})


def test_the_same_work_through_dyn_is_counted_too() -> None:
    # Fifty elements: ``+`` on dyn operands may be a list concatenation, which
    # the step bound already prices per element.
    fifty = "[" + ", ".join(str(i) for i in range(50)) + "]"
    program = ENVIRONMENT.compile(
        f'{fifty}.map(i, dyn(request.headers["x-big"]) + dyn(request.model)).size() > 0'
    )
    with pytest.raises(CelEvalError, match="cost budget"):
        program.evaluate({"request": BIG_HEADER, "pod": None})


def test_a_long_literal_concatenated_per_element_is_refused_at_load() -> None:
    literal = '"' + "a" * 60_000 + '"'
    with pytest.raises(CelCompileError, match="cost bound") as error:
        ENVIRONMENT.compile(f"{FIVE_THOUSAND}.map(i, {literal} + request.model).size() > 0")
    assert "characters of strings" in error.value.message


def test_the_same_work_where_only_cel_expr_python_could_run_it_is_refused_at_load() -> None:
    # Message construction is not lowered; cel-expr-python has no budget to stop it.
    header = 'request.headers["x-big"]'
    with pytest.raises(CelCompileError, match="cannot count the string work"):
        ENVIRONMENT.compile(
            f"{FIVE_THOUSAND}.map(i, policyd.Pod{{name: {header} + {header}}}).size() > 0"
        )
