"""The CEL standard library as a table of overloads, keyed by cel-cpp's overload ids.

The type checker resolves every call to overload ids (``add_int64``,
``less_double``, ``size_string``...). When a call resolves to exactly one
overload and the static argument types match it, the compiler uses that
overload's ``inline`` Python template (exact for those types) or its ``impl``
directly. Otherwise (``dyn`` arguments, several candidate overloads, an
unchecked expression) it dispatches at run time on the arguments' CEL kinds
over every overload of the function, which also covers the heterogeneous
numeric comparisons (``dyn(1) < 2.0``) cel-cpp registers only at run time.

Logical operators, the conditional, ``@not_strictly_false``, ``has()`` and
field selection are structural and live in the compiler, not here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Final

from policyd.cel import chrono, runtime
from policyd.cel.errors import CelEvalError
from policyd.cel.runtime import (
    BOOL,
    BYTES,
    DOUBLE,
    DURATION,
    INT,
    LIST,
    MAP,
    STRING,
    TIMESTAMP,
    UINT,
)

ANY: Final = None


@dataclass(frozen=True, slots=True)
class Overload:
    """One overload: its id, function, call style, argument kinds and implementation.

    ``inline`` is a Python expression template over ``{0}``, ``{1}``... that is
    exact when the arguments have exactly ``kinds``; ``checked`` names the
    integer range (``int64`` / ``uint64``) its result must be checked against.
    """

    id: str
    function: str
    receiver: bool
    kinds: tuple[str | None, ...]
    impl: Callable[..., Any]
    inline: str | None = None
    checked: str | None = None


def _comparisons(
    function: str, prefix: str, operator: str, impl: Callable[..., Any]
) -> list[Overload]:
    same = [
        (BOOL, "bool"),
        (INT, "int64"),
        (UINT, "uint64"),
        (DOUBLE, "double"),
        (STRING, "string"),
        (BYTES, "bytes"),
    ]
    overloads = [
        Overload(
            f"{prefix}_{name}", function, False, (kind, kind), impl, f"({{0}} {operator} {{1}})"
        )
        for kind, name in same
    ]
    overloads += [
        Overload(
            f"{prefix}_{name}",
            function,
            False,
            (kind, kind),
            impl,
            f"({{0}}.nanos {operator} {{1}}.nanos)",
        )
        for kind, name in ((TIMESTAMP, "timestamp"), (DURATION, "duration"))
    ]
    numeric = ((INT, "int64"), (UINT, "uint64"), (DOUBLE, "double"))
    overloads += [
        Overload(f"{prefix}_{left_name}_{right_name}", function, False, (left, right), impl)
        for left, left_name in numeric
        for right, right_name in numeric
        if left != right
    ]
    return overloads


def _timestamp_accessor(
    function: str, id_stem: str, impl: Callable[..., int], tz_id: str | None = None
) -> list[Overload]:
    return [
        Overload(id_stem, function, True, (TIMESTAMP,), impl),
        Overload(tz_id or f"{id_stem}_with_tz", function, True, (TIMESTAMP, STRING), impl),
    ]


def _not_implemented_in_cel_cpp(function: str, kind: str) -> Callable[[Any], Any]:
    def fail(value: Any) -> Any:
        raise CelEvalError(f"no matching overload for '{function}' applied to ({kind})")

    return fail


_OVERLOADS: Final[tuple[Overload, ...]] = (
    # arithmetic
    Overload("add_int64", "_+_", False, (INT, INT), runtime.add_int, "{0} + {1}", "int64"),
    Overload("add_uint64", "_+_", False, (UINT, UINT), runtime.add_uint, "{0} + {1}", "uint64"),
    Overload("add_double", "_+_", False, (DOUBLE, DOUBLE), lambda a, b: a + b, "({0} + {1})"),
    Overload("add_string", "_+_", False, (STRING, STRING), lambda a, b: a + b, "({0} + {1})"),
    Overload("add_bytes", "_+_", False, (BYTES, BYTES), lambda a, b: bytes(a) + b),
    Overload("add_list", "_+_", False, (LIST, LIST), runtime.add_list),
    Overload(
        "add_timestamp_duration",
        "_+_",
        False,
        (TIMESTAMP, DURATION),
        runtime.add_timestamp_duration,
    ),
    Overload(
        "add_duration_timestamp",
        "_+_",
        False,
        (DURATION, TIMESTAMP),
        runtime.add_duration_timestamp,
    ),
    Overload("add_duration_duration", "_+_", False, (DURATION, DURATION), runtime.add_durations),
    Overload(
        "subtract_int64", "_-_", False, (INT, INT), runtime.subtract_int, "{0} - {1}", "int64"
    ),
    Overload(
        "subtract_uint64", "_-_", False, (UINT, UINT), runtime.subtract_uint, "{0} - {1}", "uint64"
    ),
    Overload("subtract_double", "_-_", False, (DOUBLE, DOUBLE), lambda a, b: a - b, "({0} - {1})"),
    Overload(
        "subtract_timestamp_timestamp",
        "_-_",
        False,
        (TIMESTAMP, TIMESTAMP),
        runtime.subtract_timestamps,
    ),
    Overload(
        "subtract_timestamp_duration",
        "_-_",
        False,
        (TIMESTAMP, DURATION),
        runtime.subtract_timestamp_duration,
    ),
    Overload(
        "subtract_duration_duration", "_-_", False, (DURATION, DURATION), runtime.subtract_durations
    ),
    Overload(
        "multiply_int64", "_*_", False, (INT, INT), runtime.multiply_int, "{0} * {1}", "int64"
    ),
    Overload(
        "multiply_uint64", "_*_", False, (UINT, UINT), runtime.multiply_uint, "{0} * {1}", "uint64"
    ),
    Overload("multiply_double", "_*_", False, (DOUBLE, DOUBLE), lambda a, b: a * b, "({0} * {1})"),
    Overload("divide_int64", "_/_", False, (INT, INT), runtime.divide_int),
    Overload("divide_uint64", "_/_", False, (UINT, UINT), runtime.divide_uint),
    Overload("divide_double", "_/_", False, (DOUBLE, DOUBLE), runtime.divide_double),
    Overload("modulo_int64", "_%_", False, (INT, INT), runtime.modulo_int),
    Overload("modulo_uint64", "_%_", False, (UINT, UINT), runtime.modulo_uint),
    Overload("negate_int64", "-_", False, (INT,), runtime.negate_int, "-{0}", "int64"),
    Overload("negate_double", "-_", False, (DOUBLE,), lambda a: -a, "(-{0})"),
    Overload("logical_not", "!_", False, (BOOL,), lambda a: not a, "(not {0})"),
    # comparisons
    *_comparisons("_<_", "less", "<", runtime.less),
    *_comparisons("_<=_", "less_equals", "<=", runtime.less_equals),
    *_comparisons("_>_", "greater", ">", runtime.greater),
    *_comparisons("_>=_", "greater_equals", ">=", runtime.greater_equals),
    Overload("equals", "_==_", False, (ANY, ANY), runtime.equals),
    Overload("not_equals", "_!=_", False, (ANY, ANY), runtime.not_equals),
    # containers
    Overload("index_list", "_[_]", False, (LIST, ANY), runtime.index_list),
    Overload("index_map", "_[_]", False, (MAP, ANY), runtime.index_map),
    Overload("in_list", "@in", False, (ANY, LIST), runtime.in_list),
    Overload("in_map", "@in", False, (ANY, MAP), runtime.in_map),
    *(
        Overload(f"size_{name}", "size", False, (kind,), len, "len({0})")
        for kind, name in ((STRING, "string"), (BYTES, "bytes"), (LIST, "list"), (MAP, "map"))
    ),
    *(
        Overload(f"{name}_size", "size", True, (kind,), len, "len({0})")
        for kind, name in ((STRING, "string"), (BYTES, "bytes"), (LIST, "list"), (MAP, "map"))
    ),
    # strings
    Overload(
        "contains_string",
        "contains",
        True,
        (STRING, STRING),
        runtime.contains_string,
        "({1} in {0})",
    ),
    Overload(
        "starts_with_string",
        "startsWith",
        True,
        (STRING, STRING),
        runtime.starts_with,
        "{0}.startswith({1})",
    ),
    Overload(
        "ends_with_string",
        "endsWith",
        True,
        (STRING, STRING),
        runtime.ends_with,
        "{0}.endswith({1})",
    ),
    Overload("matches_string", "matches", True, (STRING, STRING), runtime.matches),
    Overload("matches", "matches", False, (STRING, STRING), runtime.matches),
    # conversions
    Overload("int64_to_int64", "int", False, (INT,), runtime.identity, "{0}"),
    Overload("uint64_to_int64", "int", False, (UINT,), runtime.int_from_uint),
    Overload("double_to_int64", "int", False, (DOUBLE,), runtime.int_from_double),
    Overload("string_to_int64", "int", False, (STRING,), runtime.int_from_string),
    Overload("timestamp_to_int64", "int", False, (TIMESTAMP,), runtime.int_from_timestamp),
    Overload(
        "duration_to_int64", "int", False, (DURATION,), _not_implemented_in_cel_cpp("int", DURATION)
    ),
    Overload("uint64_to_uint64", "uint", False, (UINT,), runtime.identity, "{0}"),
    Overload("int64_to_uint64", "uint", False, (INT,), runtime.uint_from_int),
    Overload("double_to_uint64", "uint", False, (DOUBLE,), runtime.uint_from_double),
    Overload("string_to_uint64", "uint", False, (STRING,), runtime.uint_from_string),
    Overload("double_to_double", "double", False, (DOUBLE,), runtime.identity, "{0}"),
    Overload("int64_to_double", "double", False, (INT,), runtime.double_from_int, "_float({0})"),
    Overload("uint64_to_double", "double", False, (UINT,), runtime.double_from_int, "_float({0})"),
    Overload("string_to_double", "double", False, (STRING,), runtime.double_from_string),
    Overload("string_to_string", "string", False, (STRING,), runtime.identity, "{0}"),
    Overload("int64_to_string", "string", False, (INT,), runtime.string_from_int),
    Overload("uint64_to_string", "string", False, (UINT,), runtime.string_from_int),
    Overload("double_to_string", "string", False, (DOUBLE,), runtime.format_double),
    Overload("bytes_to_string", "string", False, (BYTES,), runtime.string_from_bytes),
    Overload("bool_to_string", "string", False, (BOOL,), runtime.string_from_bool),
    Overload("timestamp_to_string", "string", False, (TIMESTAMP,), chrono.format_timestamp),
    Overload("duration_to_string", "string", False, (DURATION,), chrono.format_duration),
    Overload("bytes_to_bytes", "bytes", False, (BYTES,), runtime.identity, "{0}"),
    Overload("string_to_bytes", "bytes", False, (STRING,), runtime.bytes_from_string),
    Overload("bool_to_bool", "bool", False, (BOOL,), runtime.identity, "{0}"),
    Overload("string_to_bool", "bool", False, (STRING,), runtime.bool_from_string),
    Overload("timestamp_to_timestamp", "timestamp", False, (TIMESTAMP,), runtime.identity, "{0}"),
    Overload("string_to_timestamp", "timestamp", False, (STRING,), chrono.parse_timestamp),
    Overload("int64_to_timestamp", "timestamp", False, (INT,), runtime.timestamp_from_int),
    Overload("duration_to_duration", "duration", False, (DURATION,), runtime.identity, "{0}"),
    Overload("string_to_duration", "duration", False, (STRING,), chrono.parse_duration),
    Overload(
        "int64_to_duration", "duration", False, (INT,), _not_implemented_in_cel_cpp("duration", INT)
    ),
    Overload("to_dyn", "dyn", False, (ANY,), runtime.identity, "{0}"),
    Overload("type", "type", False, (ANY,), runtime.type_of),
    # timestamps and durations
    *_timestamp_accessor("getFullYear", "timestamp_to_year", chrono.full_year),
    *_timestamp_accessor("getMonth", "timestamp_to_month", chrono.month_zero_based),
    *_timestamp_accessor(
        "getDate", "timestamp_to_day_of_month_1_based", chrono.day_of_month_one_based
    ),
    *_timestamp_accessor(
        "getDayOfMonth", "timestamp_to_day_of_month", chrono.day_of_month_zero_based
    ),
    *_timestamp_accessor("getDayOfWeek", "timestamp_to_day_of_week", chrono.day_of_week),
    *_timestamp_accessor("getDayOfYear", "timestamp_to_day_of_year", chrono.day_of_year),
    *_timestamp_accessor("getHours", "timestamp_to_hours", chrono.hours),
    *_timestamp_accessor("getMinutes", "timestamp_to_minutes", chrono.minutes),
    *_timestamp_accessor(
        "getSeconds", "timestamp_to_seconds", chrono.seconds, "timestamp_to_seconds_tz"
    ),
    *_timestamp_accessor("getMilliseconds", "timestamp_to_milliseconds", chrono.milliseconds),
    Overload("duration_to_hours", "getHours", True, (DURATION,), chrono.duration_hours),
    Overload("duration_to_minutes", "getMinutes", True, (DURATION,), chrono.duration_minutes),
    Overload("duration_to_seconds", "getSeconds", True, (DURATION,), chrono.duration_seconds),
    Overload(
        "duration_to_milliseconds",
        "getMilliseconds",
        True,
        (DURATION,),
        chrono.duration_milliseconds,
    ),
)

OVERLOADS: Final[Mapping[str, Overload]] = {overload.id: overload for overload in _OVERLOADS}


@cache
def dispatcher(function: str, receiver: bool, arity: int) -> Callable[..., Any] | None:
    """A callable choosing the overload of ``function`` by its arguments' kinds at
    run time, or None when the standard library has no such function."""
    candidates = [
        overload
        for overload in _OVERLOADS
        if overload.function == function
        and overload.receiver == receiver
        and len(overload.kinds) == arity
    ]
    if not candidates:
        return None
    exact = {o.kinds: o.impl for o in candidates if ANY not in o.kinds}
    generic = [o for o in candidates if ANY in o.kinds]
    kind_of = runtime.kind_of

    def dispatch(*args: Any) -> Any:
        kinds = tuple(kind_of(arg) for arg in args)
        impl = exact.get(kinds)
        if impl is None:
            for overload in generic:
                if all(
                    want in (ANY, kind) for want, kind in zip(overload.kinds, kinds, strict=True)
                ):
                    impl = overload.impl
                    break
            else:
                runtime.no_overload(function, *args)
        return impl(*args)

    return dispatch
