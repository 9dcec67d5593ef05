"""The load-time cost bound: a rule that could stall the proxy does not load."""

from __future__ import annotations

import pytest
from cel_expr_python import cel

from policyd.cel import CelCompileError, CelEvalError, Environment, pod_type, request_type
from policyd.policy.request import Request
from policyd.pool.pod import Pod

ENVIRONMENT = Environment(
    {
        "pod": pod_type(),
        "request": request_type(),
        "params.models": cel.Type.List(cel.Type.STRING),
        "matrix": cel.Type.List(cel.Type.List(cel.Type.INT)),
    }
)


@pytest.mark.parametrize(
    ("source", "column", "iterated"),
    [
        (
            "pod.active_loras.exists(a, pod.waiting_loras.exists(w, w == a))",
            24,
            "`pod.active_loras`",
        ),
        ("pod.active_loras.all(a, a in pod.waiting_loras)", 21, "`pod.active_loras`"),
        ("matrix.exists(row, row.exists(v, v > 3))", 14, "`matrix`"),
        ("pod.labels.exists(k, pod.active_loras.map(a, a + k).size() > 1)", 18, "`pod.labels`"),
        (
            "pod.active_loras.filter(a, pod.waiting_loras != pod.active_loras).size() > 0",
            24,
            "`pod.active_loras`",
        ),
    ],
)
def test_quadratic_rules_are_rejected_with_the_position_and_why(
    source: str, column: int, iterated: str
) -> None:
    with pytest.raises(CelCompileError) as error:
        ENVIRONMENT.compile(source)
    assert error.value.line == 1
    assert error.value.column == column
    assert error.value.message.startswith("cost bound:")
    assert iterated in error.value.message
    assert "square of the input size" in error.value.message


def test_a_huge_literal_fan_out_is_rejected_by_the_absolute_limit() -> None:
    literal = "[" + ", ".join(str(i) for i in range(60)) + "]"
    source = f"{literal}.all(a, {literal}.all(b, {literal}.all(c, a + b + c >= 0)))"
    with pytest.raises(CelCompileError, match="above the limit"):
        ENVIRONMENT.compile(source)


@pytest.mark.parametrize(
    "source",
    [
        "pod.active_loras.exists(a, a.startsWith(request.model))",
        "pod.active_loras.exists(a, a in pod.labels)",
        "pod.active_loras.exists(a, ['x', 'y'].exists(b, a == b))",
        "pod.active_loras.exists(a, params.models.exists(m, m == a))",
        "pod.active_loras.map(a, a + '!').filter(a, a.size() > 3).size() > 0",
        "request.model in pod.active_loras && pod.waiting_queue < 10",
    ],
)
def test_linear_rules_load_and_report_their_estimate(source: str) -> None:
    program = ENVIRONMENT.compile(source, constants={"params.models": ["a", "b", "c"]})
    assert any(line.startswith("estimated cost") for line in program.report)
    assert "N^2" not in " ".join(program.report)


def test_the_estimate_counts_constant_lists_at_their_size() -> None:
    program = ENVIRONMENT.compile(
        "params.models.exists(m, m == request.model)", constants={"params.models": ["a", "b"]}
    )
    estimate = next(line for line in program.report if line.startswith("estimated cost"))
    assert "*N" not in estimate.split(" steps")[0]


def test_nesting_too_deep_to_analyse_does_not_load() -> None:
    source = "".join(f"[1].exists(v{i}, " for i in range(25)) + "true" + ")" * 25
    with pytest.raises(CelCompileError, match="nests too deeply"):
        ENVIRONMENT.compile(source)
    with pytest.raises(CelCompileError, match="recursion"):
        ENVIRONMENT.compile(" + ".join(["1"] * 400))


STRINGS = Environment({"request": request_type(), "pod": pod_type()})
HUNDRED = "[" + ", ".join(str(i) for i in range(100)) + "]"


def _request(header: str) -> Request:
    return Request(model="m", headers={"x": header})


def test_string_work_within_the_budget_evaluates_and_each_evaluation_starts_afresh() -> None:
    # 100 copies of a 4,000-character header: 800,000 characters, under the budget.
    program = STRINGS.compile(f'{HUNDRED}.map(i, request.headers["x"] + "!").size()')
    activation = {"request": _request("a" * 4_000), "pod": None}
    assert program.evaluate(activation) == 100
    assert program.evaluate(activation) == 100  # a second evaluation has its own budget


def test_string_work_past_the_budget_is_an_error_that_or_can_absorb() -> None:
    program = STRINGS.compile(
        f'{HUNDRED}.map(i, request.headers["x"] + "!").size() > 0 || request.model == "m"'
    )
    assert program.evaluate({"request": _request("a" * 20_000), "pod": None}) is True
    alone = STRINGS.compile(f'{HUNDRED}.map(i, request.headers["x"] + "!").size() > 0')
    with pytest.raises(CelEvalError, match="cost budget"):
        alone.evaluate({"request": _request("a" * 20_000), "pod": None})


def test_only_programs_with_string_work_count_it() -> None:
    seed = STRINGS.compile("pod.waiting_queue < 50 && request.model in pod.active_loras")
    assert seed.python_source is not None and "_spent" not in seed.python_source
    concat = STRINGS.compile('request.model + "-lora" == "m-lora"')
    assert concat.python_source is not None and "_spent" in concat.python_source


def test_string_work_known_at_load_time_is_in_the_report() -> None:
    program = STRINGS.compile(f'{HUNDRED}.exists(i, request.model.contains("abcd"))')
    estimate = next(line for line in program.report if line.startswith("estimated cost"))
    assert "400 characters of string work known at load time" in estimate


def test_iterations_are_counted_only_where_the_load_time_bound_cannot_know_them() -> None:
    over_input = STRINGS.compile("pod.active_loras.exists(a, a == request.model)")
    assert over_input.python_source is not None and "_iterations" in over_input.python_source
    literal = STRINGS.compile("[1, 2, 3].exists(i, pod.waiting_queue == i)")
    assert literal.python_source is not None and "_iterations" not in literal.python_source
    nested = STRINGS.compile("pod.active_loras.exists(a, ['x', 'y'].exists(b, a == b))")
    assert nested.python_source is not None and nested.python_source.count("_iterations +=") == 2


def test_long_input_lists_within_the_iteration_budget_evaluate() -> None:
    program = STRINGS.compile("pod.active_loras.exists(a, a == request.model)")
    pod = Pod(name="p", address="a:1", active_loras=[f"x{i}" for i in range(50_000)] + ["m"])
    assert program.evaluate({"pod": pod, "request": _request("")}) is True
