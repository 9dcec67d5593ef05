"""CEL semantics the compiler must get exactly right, one property at a time.

Values come from variables (not literals) wherever constant folding would
otherwise decide the answer at load time, so the generated code is what runs.
"""

from __future__ import annotations

from typing import Any

import pytest
from cel_expr_python import cel

from policyd.cel import CelEvalError, Environment, pod_type, request_type
from policyd.cel.runtime import REGEX_MAX_MEM, RegexCache
from policyd.cel.values import CelType, Duration, Timestamp, UInt
from policyd.policy.request import Request
from policyd.pool.pod import Pod

ENVIRONMENT = Environment(
    {
        "pod": pod_type(),
        "request": request_type(),
        "x": cel.Type.INT,
        "y": cel.Type.INT,
        "u": cel.Type.UINT,
        "d": cel.Type.DOUBLE,
        "s": cel.Type.STRING,
        "l": cel.Type.List(cel.Type.INT),
        "m": cel.Type.Map(cel.Type.STRING, cel.Type.INT),
        "dy": cel.Type.DYN,
        "t": cel.Type.TIMESTAMP,
        "age": cel.Type.DURATION,
    }
)
POD = Pod(
    "vllm-0",
    "10.0.0.1:8000",
    labels={"zone": "a"},
    waiting_queue=3,
    kv_cache=0.25,
    active_loras=("sql-lora", "chat-lora"),
    metrics_age=Duration(299_999_999),
)
REQUEST = Request(model="sql-lora", headers={"x-zone": "a"})


def run(source: str, **values: Any) -> Any:
    program = ENVIRONMENT.compile(source)
    assert program.lowered, program.report
    return program.evaluate({"pod": POD, "request": REQUEST, **values})


def fails(source: str, **values: Any) -> str:
    with pytest.raises(CelEvalError) as error:
        run(source, **values)
    return str(error.value)


# -- logic ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("x / y > 0 || true", True),
        ("true || x / y > 0", True),
        ("x / y > 0 && false", False),
        ("false && x / y > 0", False),
        ("x / y > 0 || x == 1 || s == 'a'", True),
        ("!(x / y > 0 && false)", True),
    ],
)
def test_and_or_absorb_an_error_from_either_side(source: str, expected: bool) -> None:
    assert run(source, x=1, y=0, s="a") is expected


@pytest.mark.parametrize("source", ["x / y > 0 || false", "x / y > 0 && true", "true && x / y > 0"])
def test_and_or_keep_the_error_when_the_other_side_does_not_decide(source: str) -> None:
    assert "division by zero" in fails(source, x=1, y=0)


def test_conditional_evaluates_only_the_chosen_branch() -> None:
    assert run("x > 0 ? x : x / y", x=5, y=0) == 5
    assert run("x < 0 ? x / y : -x", x=5, y=0) == -5
    assert "division by zero" in fails("x > 0 ? x / y : 0", x=5, y=0)


def test_an_unbound_variable_is_an_error_that_logic_can_absorb() -> None:
    program = ENVIRONMENT.compile("x > 0 || pod.waiting_queue > 0")
    assert program.evaluate({"x": 1}) is True
    with pytest.raises(CelEvalError, match="no value bound for variable 'pod'"):
        program.evaluate({"x": 0})


# -- integers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "values"),
    [
        ("x + y", {"x": 2**63 - 1, "y": 1}),
        ("x - y", {"x": -(2**63), "y": 1}),
        ("x * y", {"x": 2**62, "y": 2}),
        ("-x", {"x": -(2**63)}),
        ("x / y", {"x": -(2**63), "y": -1}),
        ("x % y", {"x": -(2**63), "y": -1}),
        ("u - 1u", {"u": UInt(0)}),
        ("u + 1u", {"u": UInt(2**64 - 1)}),
        ("u * 2u", {"u": UInt(2**63)}),
        ("uint(x)", {"x": -1}),
        ("int(u)", {"u": UInt(2**63)}),
        ("int(d)", {"d": 9.3e18}),
    ],
)
def test_int64_and_uint64_overflow_is_an_error(source: str, values: dict[str, Any]) -> None:
    assert "overflow" in fails(source, **values) or "range" in fails(source, **values)


@pytest.mark.parametrize(
    ("x", "y", "quotient", "remainder"),
    [(7, 2, 3, 1), (-7, 2, -3, -1), (7, -2, -3, 1), (-7, -2, 3, -1)],
)
def test_division_truncates_toward_zero(x: int, y: int, quotient: int, remainder: int) -> None:
    assert run("x / y", x=x, y=y) == quotient
    assert run("x % y", x=x, y=y) == remainder


def test_division_by_zero_is_an_error_for_int_and_uint_but_not_double() -> None:
    assert "division by zero" in fails("x / y", x=1, y=0)
    assert "modulus by zero" in fails("x % y", x=1, y=0)
    assert "division by zero" in fails("u / u", u=UInt(0))
    assert run("d / 0.0", d=1.0) == float("inf")
    assert run("string(d / 0.0)", d=0.0) == "nan"


def test_uint_results_are_uint_values() -> None:
    result = run("u + 1u", u=UInt(1))
    assert result == 2
    assert isinstance(result, UInt)
    assert run("type(u) == uint", u=UInt(3)) is True


# -- equality and ordering across kinds -------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("dy == 1.0", True),
        ("dy == 1u", True),
        ("dy < 2.5", True),
        ("dy > 0u", True),
        ("dy in [1.0, 2.0]", True),
        ("dy in {1u: 'one'}", True),
        ("[dy] == [1.0]", True),
    ],
)
def test_numbers_compare_by_value_across_int_uint_and_double(source: str, expected: bool) -> None:
    assert run(source, dy=1) is expected


def test_bool_is_not_a_number() -> None:
    assert run("dy == 1", dy=True) is False
    assert run("dy in [1, 2]", dy=True) is False
    assert run("dy in {1: 'one'}", dy=True) is False
    assert "no matching overload" in fails("dy < 1", dy=True)
    assert "no matching overload" in fails("dy + 1", dy=True)


def test_nan_is_unequal_to_itself_even_inside_lists() -> None:
    assert run("d == d", d=float("nan")) is False
    assert run("[d] == [d]", d=float("nan")) is False
    assert run("d in [d]", d=float("nan")) is False


def test_ordering_of_mismatched_kinds_is_an_error() -> None:
    assert "no matching overload" in fails("dy < 'a'", dy=1)


# -- containers -------------------------------------------------------------------------


def test_in_on_lists_and_maps() -> None:
    assert run("request.model in pod.active_loras") is True
    assert run("'zone' in pod.labels") is True
    assert run("'region' in pod.labels") is False
    assert run("x in l", x=3, l=(1, 2, 3)) is True
    assert run("'a' in m", m={"a": 1}) is True


def test_list_index_out_of_range_or_negative_is_an_error() -> None:
    assert run("l[1]", l=(5, 6)) == 6
    assert "out of range" in fails("l[x]", l=(5, 6), x=2)
    assert "out of range" in fails("l[x]", l=(5, 6), x=-1)


def test_missing_map_key_is_an_error_that_names_the_key() -> None:
    assert "region" in fails("pod.labels['region'] == 'x'")
    assert run("pod.labels.zone") == "a"


def test_has_tests_map_keys_and_proto3_field_presence() -> None:
    assert run("has(pod.labels.zone)") is True
    assert run("has(request.headers.zone)") is False
    assert run("has(pod.name)") is True
    assert run("has(request.target_model)") is False  # "" is the proto3 default
    assert run("has(pod.active_loras)") is True
    assert run("has(pod.waiting_loras)") is False


def test_repeated_map_keys_are_an_error() -> None:
    assert "repeated map key" in fails("{s: 1, 'a': 2}", s="a")


# -- macros -----------------------------------------------------------------------------


def test_macros() -> None:
    assert run("pod.active_loras.exists(a, a.startsWith('chat'))") is True
    assert run("pod.active_loras.all(a, a.endsWith('-lora'))") is True
    assert run("l.exists_one(v, v > 1)", l=(1, 2)) is True
    assert run("l.exists_one(v, v > 0)", l=(1, 2)) is False
    assert run("l.map(v, v * 2)", l=(1, 2)) == [2, 4]
    assert run("l.filter(v, v % 2 == 0)", l=(1, 2, 3, 4)) == [2, 4]
    assert run("l.map(v, v > 1, v * 10)", l=(1, 2, 3)) == [20, 30]
    assert run("m.exists(k, k == 'b')", m={"a": 1, "b": 2}) is True


def test_exists_and_all_absorb_errors_like_or_and_and() -> None:
    assert run("l.exists(v, 6 / v > 1)", l=(0, 2)) is True
    assert "division by zero" in fails("l.exists(v, 6 / v > 5)", l=(0, 2))
    assert run("l.all(v, 6 / v > 5)", l=(0, 2)) is False
    assert "division by zero" in fails("l.all(v, 6 / v > 1)", l=(0, 2))


def test_map_filter_and_exists_one_propagate_errors() -> None:
    assert "division by zero" in fails("l.map(v, 6 / v)", l=(1, 0))
    assert "division by zero" in fails("l.filter(v, 6 / v > 1)", l=(1, 0))
    assert "division by zero" in fails("l.exists_one(v, 6 / v > 1)", l=(1, 0))


# -- strings ----------------------------------------------------------------------------


def test_string_functions() -> None:
    assert run("size(s)", s="🐱é") == 2
    assert run("s.size()", s="abc") == 3
    assert run("s.startsWith('ab') && s.endsWith('bc') && s.contains('b')", s="abc") is True
    assert run("s + '!'", s="hi") == "hi!"


def test_matches_is_an_re2_substring_search() -> None:
    assert run("s.matches('ubb')", s="hubba") is True
    assert run("s.matches('^ubb')", s="hubba") is False
    assert run("matches(s, '(a|😀){2}')", s="🐱😀😀") is True
    assert run("s.matches(pattern)".replace("pattern", "'b$'"), s="a\nb") is True


def test_an_invalid_or_non_re2_regex_is_a_runtime_error() -> None:
    assert "invalid regular expression" in fails("s.matches('[')", s="a")
    assert "invalid regular expression" in fails("s.matches('(a)\\\\1')", s="aa")
    assert run("s.matches('[') || true", s="a") is True


# -- conversions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "values", "expected"),
    [
        ("int(s)", {"s": " 42 "}, 42),
        ("int(d)", {"d": -2.9}, -2),
        ("uint(d)", {"d": 2.9}, UInt(2)),
        ("double(s)", {"s": "1.5e3"}, 1500.0),
        ("double(x)", {"x": 3}, 3.0),
        ("string(d)", {"d": 1234567.0}, "1.234567e+06"),
        ("string(d)", {"d": 0.1}, "0.1"),
        ("string(u)", {"u": UInt(7)}, "7"),
        ("string(dy)", {"dy": b"\xc3\xa9"}, "é"),
        ("bytes(s)", {"s": "é"}, b"\xc3\xa9"),
        ("bool(s)", {"s": "True"}, True),
        ("dyn(x) == 3.0", {"x": 3}, True),
        ("type(dy)", {"dy": UInt(1)}, CelType("uint")),
        ("type(pod)", {}, CelType("policyd.Pod")),
        ("type(pod.metrics_age)", {}, CelType("google.protobuf.Duration")),
        ("type(l) == list && type(m) == map", {"l": (), "m": {}}, True),
    ],
)
def test_conversions(source: str, values: dict[str, Any], expected: Any) -> None:
    result = run(source, **values)
    assert result == expected
    assert type(result) is type(expected)


@pytest.mark.parametrize(
    ("source", "values"),
    [
        ("int(s)", {"s": "1_000"}),
        ("int(s)", {"s": "0x10"}),
        ("uint(s)", {"s": "-1"}),
        ("string(dy)", {"dy": b"\xff"}),
        ("bool(s)", {"s": "yes"}),
        ("int(d)", {"d": float("nan")}),
    ],
)
def test_bad_conversions_are_errors(source: str, values: dict[str, Any]) -> None:
    fails(source, **values)


# -- timestamps and durations --------------------------------------------------------------


def test_durations_keep_nanoseconds() -> None:
    assert run("pod.metrics_age < duration('300ms')") is True
    assert run("age - duration('1s') == duration('1ns')", age=Duration(1_000_000_001)) is True
    assert run("string(age)", age=Duration(-1_500_000_000)) == "-1.500s"
    assert run("age.getMilliseconds()", age=Duration(1_234_567_890)) == 234
    result = run("age + duration('1h1m')", age=Duration(1))
    assert result == Duration(3_660_000_000_001)


def test_timestamps_keep_nanoseconds_and_time_zones() -> None:
    stamp = Timestamp(1_234_567_890_000_000_001)
    assert run("string(t)", t=stamp) == "2009-02-13T23:31:30.000000001Z"
    assert run("t > timestamp('2009-02-13T23:31:30Z')", t=stamp) is True
    assert run("t.getHours('+05:30')", t=stamp) == 5
    assert run("t.getDayOfWeek('America/St_Johns')", t=stamp) == 5
    assert run("t - timestamp(0) > duration('1s')", t=stamp) is True
    assert "time zone" in fails("t.getHours('Mars/Olympus')", t=stamp)


def test_timestamp_and_duration_ranges_are_enforced() -> None:
    assert "range" in fails("t + duration('1s')", t=Timestamp(253_402_300_799_000_000_000))
    assert "range" in fails("timestamp(x)", x=-62_135_596_801)
    assert "overflow" in fails("age + age", age=Duration(9 * 10**18))


# -- the calling contract -------------------------------------------------------------------


class NoFields:
    """A pod stand-in missing every attribute."""


def test_no_python_exception_escapes_evaluate() -> None:
    program = ENVIRONMENT.compile("pod.waiting_queue < 5 && request.model in pod.active_loras")
    for activation in ({"pod": NoFields(), "request": REQUEST}, {}, {"pod": None}, {"pod": 3}):
        with pytest.raises(CelEvalError):
            program.evaluate(activation)


def test_double_fields_holding_ints_still_behave_as_doubles() -> None:
    pod = Pod("p", "10.0.0.1:8000", kv_cache=0)
    program = ENVIRONMENT.compile("type(dyn(pod.kv_cache)) == double && pod.kv_cache / 2.0 == 0.0")
    assert program.evaluate({"pod": pod}) is True


def test_results_are_plain_python_values() -> None:
    assert run("pod.labels") == {"zone": "a"}
    assert run("{'a': [1u, 2.5, null, b'x']}") == {"a": (UInt(1), 2.5, None, b"x")}
    assert run("pod.metrics_age") == Duration(299_999_999)


def test_the_regex_cache_keeps_at_most_its_bytes_oldest_out_first() -> None:
    cache = RegexCache(3 * REGEX_MAX_MEM + 100)
    first = cache.search("a+")
    assert cache.search("a+") is first  # a hit is the same compiled search
    for pattern in ("b+", "c+", "d+"):
        cache.search(pattern)
    assert len(cache) == 3
    assert cache.held_bytes <= 3 * REGEX_MAX_MEM + 100
    assert cache.search("a+") is not first  # the oldest went first
    assert cache.search("a+")("xaax") is True
