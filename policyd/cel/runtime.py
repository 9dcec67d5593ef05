"""CEL semantics on the Python values of ``values.py``: what compiled programs call.

Each function implements one CEL operation exactly, for any runtime types, and
raises ``CelEvalError`` for what CEL calls an error (overflow, division by
zero, no such key, no matching overload...). The compiler calls these where the
static types leave a choice open (``dyn``) or where Python's own operator
differs from CEL (``/`` and ``%`` truncate in CEL, ``list[-1]`` is an error,
``true == 1`` is false); where the static types make a Python operator exact
it inlines the operator instead.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any, Final, NoReturn

import re2

from policyd.cel import chrono
from policyd.cel.errors import CelEvalError
from policyd.cel.values import (
    BOOL_TYPE,
    BYTES_TYPE,
    DOUBLE_TYPE,
    DURATION_TYPE,
    INT64_MAX,
    INT64_MIN,
    INT_TYPE,
    LIST_TYPE,
    MAP_TYPE,
    NANOS_PER_SECOND,
    NULL_TYPE,
    STRING_TYPE,
    TIMESTAMP_TYPE,
    TYPE_TYPE,
    UINT64_MAX,
    UINT_TYPE,
    CelType,
    Duration,
    Timestamp,
    UInt,
)

# -- kinds ----------------------------------------------------------------------
# A value's CEL kind decides overloads at run time. Messages are any other object.

BOOL: Final = "bool"
INT: Final = "int"
UINT: Final = "uint"
DOUBLE: Final = "double"
STRING: Final = "string"
BYTES: Final = "bytes"
NULL: Final = "null"
LIST: Final = "list"
MAP: Final = "map"
TIMESTAMP: Final = "timestamp"
DURATION: Final = "duration"
TYPE: Final = "type"
MESSAGE: Final = "message"

NUMERIC_KINDS: Final = frozenset({INT, UINT, DOUBLE})
ORDERED_KINDS: Final = frozenset({BOOL, INT, UINT, DOUBLE, STRING, BYTES, TIMESTAMP, DURATION})

_KIND_OF_CLASS: Final[dict[type, str]] = {
    bool: BOOL,
    int: INT,
    UInt: UINT,
    float: DOUBLE,
    str: STRING,
    bytes: BYTES,
    type(None): NULL,
    list: LIST,
    tuple: LIST,
    dict: MAP,
    Timestamp: TIMESTAMP,
    Duration: DURATION,
    CelType: TYPE,
}

# A kind's CEL type as a value (``type(x)``); ir and lowering name types with it too.
TYPE_OF_KIND: Final[dict[str, CelType]] = {
    BOOL: BOOL_TYPE,
    INT: INT_TYPE,
    UINT: UINT_TYPE,
    DOUBLE: DOUBLE_TYPE,
    STRING: STRING_TYPE,
    BYTES: BYTES_TYPE,
    NULL: NULL_TYPE,
    LIST: LIST_TYPE,
    MAP: MAP_TYPE,
    TIMESTAMP: TIMESTAMP_TYPE,
    DURATION: DURATION_TYPE,
    TYPE: TYPE_TYPE,
}


def kind_of(value: Any) -> str:
    kind = _KIND_OF_CLASS.get(value.__class__)
    if kind is not None:
        return kind
    if isinstance(value, UInt):
        return UINT
    if isinstance(value, int):
        return INT
    if isinstance(value, float):
        return DOUBLE
    if isinstance(value, str):
        return STRING
    if isinstance(value, bytes | bytearray):
        return BYTES
    if isinstance(value, Mapping):
        return MAP
    if isinstance(value, Sequence):
        return LIST
    return MESSAGE


def type_of(value: Any) -> CelType:
    """``type(value)`` from the value alone. A message's type is known statically
    wherever the checker saw it (``type(pod)``); a Python object reached only
    through ``dyn`` carries no message name, so that case is an error."""
    kind = kind_of(value)
    if kind == MESSAGE:
        raise CelEvalError(
            f"type() of a {value.__class__.__name__} held as dyn is unknown; "
            "apply type() where its message type is declared"
        )
    return TYPE_OF_KIND[kind]


# -- errors ---------------------------------------------------------------------


def no_overload(function: str, *args: Any) -> NoReturn:
    kinds = ", ".join(kind_of(arg) for arg in args)
    raise CelEvalError(f"no matching overload for '{function}' applied to ({kinds})")


def overflow(what: str = "integer") -> NoReturn:
    raise CelEvalError(f"{what} overflow")


def as_error(error: Exception) -> CelEvalError:
    """The CEL error for a Python exception raised while evaluating a subexpression.

    Programming errors in the compiler itself are not CEL errors: they escape,
    so that no ``||`` can absorb them into a quietly wrong answer.
    """
    if error.__class__ is CelEvalError:
        return error
    if isinstance(error, NameError | AssertionError | SyntaxError):
        raise error
    if isinstance(error, KeyError):
        # Raised by an inline lookup of a key written in the expression, never a
        # computed one (``index_map``), so naming it shows no request value.
        key = error.args[0] if error.args else "?"
        return CelEvalError(f"no such key: {key!r}")
    if isinstance(error, ZeroDivisionError):
        return CelEvalError("division by zero")
    if isinstance(error, AttributeError):
        return CelEvalError(f"no such field: {getattr(error, 'name', None) or error}")
    if isinstance(error, TypeError):
        return CelEvalError(f"no matching overload: {error}")
    if isinstance(error, OverflowError):
        return CelEvalError("overflow")
    if isinstance(error, RecursionError):
        return CelEvalError("expression nests too deeply to evaluate")
    return CelEvalError(f"{error.__class__.__name__}: {error}")


def unbound(name: str) -> NoReturn:
    raise CelEvalError(f"no value bound for variable {name!r}")


def logic_failure(*operands: Any) -> CelEvalError:
    """``&&`` / ``||`` got no deciding operand: the first error, else the misuse."""
    for operand in operands:
        if operand.__class__ is CelEvalError:
            return operand
    return CelEvalError("no matching overload for logical operator applied to a non-bool")


def logic_error(*operands: Any) -> NoReturn:
    raise logic_failure(*operands)


def condition_error(condition: Any) -> NoReturn:
    raise CelEvalError(f"no matching overload for '_?_:_' on a {kind_of(condition)} condition")


# -- equality and ordering ---------------------------------------------------------


def equals(left: Any, right: Any) -> bool:
    """CEL ``==``: numbers compare by value across int/uint/double; other kinds
    must match (``true != 1``); lists and maps compare element-wise."""
    left_kind = kind_of(left)
    right_kind = kind_of(right)
    if left_kind == right_kind:
        if left_kind == LIST:
            return len(left) == len(right) and all(
                equals(a, b) for a, b in zip(left, right, strict=True)
            )
        if left_kind == MAP:
            if len(left) != len(right):
                return False
            for key, value in left.items():
                found, other = map_lookup(right, key)
                if not found or not equals(value, other):
                    return False
            return True
        return bool(left == right)
    if left_kind in NUMERIC_KINDS and right_kind in NUMERIC_KINDS:
        if DOUBLE in (left_kind, right_kind):
            return float(left) == float(right)
        return bool(left == right)
    return False


def not_equals(left: Any, right: Any) -> bool:
    return not equals(left, right)


def _ordered(function: str, left: Any, right: Any) -> tuple[Any, Any]:
    """Operands as Python values whose ``<`` is CEL's, or raise no-overload."""
    left_kind = kind_of(left)
    right_kind = kind_of(right)
    if left_kind == right_kind and left_kind in ORDERED_KINDS:
        return left, right
    if left_kind in NUMERIC_KINDS and right_kind in NUMERIC_KINDS:
        if DOUBLE in (left_kind, right_kind):
            return float(left), float(right)
        return left, right
    no_overload(function, left, right)


def less(left: Any, right: Any) -> bool:
    a, b = _ordered("_<_", left, right)
    return bool(a < b)


def less_equals(left: Any, right: Any) -> bool:
    a, b = _ordered("_<=_", left, right)
    return bool(a <= b)


def greater(left: Any, right: Any) -> bool:
    a, b = _ordered("_>_", left, right)
    return bool(a > b)


def greater_equals(left: Any, right: Any) -> bool:
    a, b = _ordered("_>=_", left, right)
    return bool(a >= b)


# -- arithmetic ---------------------------------------------------------------------


def int64(value: int) -> int:
    if not INT64_MIN <= value <= INT64_MAX:
        overflow()
    return value


def uint64(value: int) -> UInt:
    if not 0 <= value <= UINT64_MAX:
        overflow("unsigned integer")
    return UInt(value)


def add_int(left: int, right: int) -> int:
    return int64(left + right)


def subtract_int(left: int, right: int) -> int:
    return int64(left - right)


def multiply_int(left: int, right: int) -> int:
    return int64(left * right)


def negate_int(value: int) -> int:
    return int64(-value)


def _truncated_quotient(left: int, right: int) -> int:
    quotient = abs(left) // abs(right)
    return -quotient if (left < 0) != (right < 0) else quotient


def divide_int(left: int, right: int) -> int:
    if right == 0:
        raise CelEvalError("division by zero")
    return int64(_truncated_quotient(left, right))


def modulo_int(left: int, right: int) -> int:
    if right == 0:
        raise CelEvalError("modulus by zero")
    if left == INT64_MIN and right == -1:
        overflow()
    return left - right * _truncated_quotient(left, right)


def add_uint(left: int, right: int) -> UInt:
    return uint64(left + right)


def subtract_uint(left: int, right: int) -> UInt:
    return uint64(left - right)


def multiply_uint(left: int, right: int) -> UInt:
    return uint64(left * right)


def divide_uint(left: int, right: int) -> UInt:
    if right == 0:
        raise CelEvalError("division by zero")
    return UInt(left // right)


def modulo_uint(left: int, right: int) -> UInt:
    if right == 0:
        raise CelEvalError("modulus by zero")
    return UInt(left % right)


def divide_double(left: float, right: float) -> float:
    """IEEE 754 division: x/0.0 is +-inf and 0.0/0.0 is NaN (Python would raise)."""
    if right == 0:
        if left == 0 or math.isnan(left):
            return math.nan
        return math.copysign(math.inf, left) * math.copysign(1.0, right)
    return float(left) / right


def add_list(left: Sequence[Any], right: Sequence[Any]) -> list[Any]:
    return [*left, *right]


def add_timestamp_duration(left: Timestamp, right: Duration) -> Timestamp:
    return chrono.checked_timestamp(left.nanos + right.nanos)


def add_duration_timestamp(left: Duration, right: Timestamp) -> Timestamp:
    return chrono.checked_timestamp(left.nanos + right.nanos)


def add_durations(left: Duration, right: Duration) -> Duration:
    return chrono.arithmetic_duration(left.nanos + right.nanos)


def subtract_timestamps(left: Timestamp, right: Timestamp) -> Duration:
    return chrono.arithmetic_duration(left.nanos - right.nanos)


def subtract_timestamp_duration(left: Timestamp, right: Duration) -> Timestamp:
    return chrono.checked_timestamp(left.nanos - right.nanos)


def subtract_durations(left: Duration, right: Duration) -> Duration:
    return chrono.arithmetic_duration(left.nanos - right.nanos)


# -- containers ---------------------------------------------------------------------


def map_lookup(container: Mapping[Any, Any], key: Any) -> tuple[bool, Any]:
    """CEL map lookup: numeric keys match across int/uint/double (``m[1.0]``
    finds the key ``1u``); ``true`` never matches ``1``."""
    kind = kind_of(key)
    if kind == DOUBLE:
        if not key.is_integer():
            return False, None
        key = int(key)
        kind = INT
    elif kind not in (STRING, INT, UINT, BOOL):
        return False, None
    try:
        value = container[key]
    except KeyError:
        return False, None
    except TypeError:
        return False, None
    if kind == BOOL or (kind in NUMERIC_KINDS and key in (0, 1)):
        # Python's dict treats True as 1: look at the stored key's own kind.
        wanted_bool = kind == BOOL
        if not any(
            stored == key and (stored.__class__ is bool) == wanted_bool for stored in container
        ):
            return False, None
    return True, value


def shown_key(key: Any) -> str:
    """A map key as an error message may show it: a string key may be a request's
    value (a credential in a header), so only its kind is named."""
    kind = kind_of(key)
    return "a string key (not shown)" if kind in (STRING, BYTES) else f"{kind} {key!r}"


def index_map(container: Mapping[Any, Any], key: Any) -> Any:
    """``m[key]`` for a key the expression computes (a key written in the
    expression is looked up inline and named when missing)."""
    found, value = map_lookup(container, key)
    if not found:
        raise CelEvalError(f"no such key: {shown_key(key)}")
    return value


def index_list(container: Sequence[Any], index: Any) -> Any:
    kind = kind_of(index)
    if kind == DOUBLE:
        if not index.is_integer():
            raise CelEvalError("invalid list index: a double that is not a whole number")
        index = int(index)
    elif kind not in (INT, UINT):
        no_overload("_[_]", container, index)
    if not 0 <= index < len(container):
        raise CelEvalError(f"index {index} out of range for a list of size {len(container)}")
    return container[index]


def in_list(element: Any, container: Sequence[Any]) -> bool:
    return any(equals(element, item) for item in container)


def in_map(element: Any, container: Mapping[Any, Any]) -> bool:
    return map_lookup(container, element)[0]


def iterate(value: Any) -> Iterable[Any]:
    """What a comprehension walks: list elements or map keys."""
    if kind_of(value) in (LIST, MAP):
        return value  # type: ignore[no-any-return]
    no_overload("comprehension range", value)


def make_map(keys: Sequence[Any], values: Sequence[Any]) -> dict[Any, Any]:
    result: dict[Any, Any] = {}
    kinds: set[str] = set()
    for key, value in zip(keys, values, strict=True):
        kind = kind_of(key)
        if kind not in (STRING, INT, UINT, BOOL):
            raise CelEvalError(f"unsupported map key type {kind}")
        if key in result:
            raise CelEvalError(f"repeated map key: {shown_key(key)}")
        kinds.add(kind)
        result[key] = value
    if BOOL in kinds and kinds & NUMERIC_KINDS and any(k is True or k is False for k in result):
        clash = [k for k in result if k.__class__ is not bool and k in (0, 1)]
        if clash:
            raise CelEvalError(
                "a map with both bool and numeric keys 0/1 cannot be represented here"
            )
    return result


def get_field(message: Any, field: str) -> Any:
    """A message field read from a Python object. Names starting with ``_`` are
    never fields, so no expression can reach ``__class__`` and friends."""
    if field.startswith("_"):
        raise CelEvalError(f"no such field: {field!r}")
    try:
        return getattr(message, field)
    except AttributeError:
        raise CelEvalError(f"no such field: {field!r}") from None


def select(operand: Any, field: str) -> Any:
    """``operand.field`` on a value whose type is only known at run time."""
    kind = kind_of(operand)
    if kind == MAP:
        found, value = map_lookup(operand, field)
        if not found:
            raise CelEvalError(f"no such key: {field!r}")
        return value
    if kind == MESSAGE:
        return get_field(operand, field)
    raise CelEvalError(f"type {kind} does not support field selection")


def has_field(operand: Any, field: str) -> bool:
    """``has(operand.field)`` at run time: map key presence, or proto3 presence
    (a scalar field is present when it is not its zero value)."""
    kind = kind_of(operand)
    if kind == MAP:
        return in_map(field, operand)
    if kind == MESSAGE:
        return is_set(get_field(operand, field))
    raise CelEvalError(f"type {kind} does not support presence tests")


def is_set(value: Any) -> bool:
    """Proto3 presence of a field value: not None, not zero, not empty."""
    if value is None:
        return False
    kind = kind_of(value)
    if kind in (TIMESTAMP, DURATION, MESSAGE):
        return True
    return bool(value)


# -- strings ------------------------------------------------------------------------


# RE2's own ceiling on one regex's memory (its program and DFA caches; 8 MiB by
# default). A pattern whose program does not fit fails to compile, a search
# whose DFA outgrows it falls back to RE2's slower, still linear, engines.
REGEX_MAX_MEM: Final = 1 << 20
# What the compiled regexes kept for reuse may hold at most: patterns that come
# from requests (``matches(request.headers["x-re"])``) are new on every request.
REGEX_CACHE_BYTES: Final = 32 << 20


def _re2_options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False
    options.never_capture = True
    options.max_mem = REGEX_MAX_MEM
    return options


_RE2_OPTIONS: Final = _re2_options()

Search = Callable[[str], bool]


def _compile_search(pattern: str) -> Search:
    """A compiled RE2 search (CEL ``matches`` is a substring match)."""
    try:
        compiled = re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as error:
        detail = error.args[0].decode() if error.args and isinstance(error.args[0], bytes) else ""
        # RE2 quotes the offending part of the pattern, which may come from a
        # request; only its reason (the text before the quote) is kept.
        reason = detail.split(":", 1)[0].strip() or "not RE2 syntax"
        raise CelEvalError(f"invalid regular expression: {reason}") from None
    raw = getattr(compiled, "_regexp", None)
    if raw is None:  # pragma: no cover - a future google-re2 without the raw handle
        return lambda text: compiled.search(text) is not None
    raw_match = raw.Match
    unanchored = re2._Anchor.UNANCHORED

    def search(text: str) -> bool:
        encoded = text.encode()
        return bool(raw_match(unanchored, encoded, 0, len(encoded))[0][0] >= 0)

    return search


class RegexCache:
    """Compiled searches by pattern, holding at most ``limit`` bytes.

    Each entry is charged its worst case: RE2's ``REGEX_MAX_MEM`` plus the
    pattern's own bytes. The oldest entries go first. A hit is one dict read
    (no lock: lookups run on the event loop); inserting takes a lock, since
    policies compile in a worker thread.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._entries: dict[str, tuple[Search, int]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def search(self, pattern: str) -> Search:
        entry = self._entries.get(pattern)
        if entry is not None:
            return entry[0]
        search = _compile_search(pattern)
        weight = REGEX_MAX_MEM + len(pattern.encode("utf-8", "surrogatepass"))
        if weight > self._limit:
            return search
        with self._lock:
            if pattern not in self._entries:
                while self._bytes + weight > self._limit:
                    oldest = next(iter(self._entries))
                    self._bytes -= self._entries.pop(oldest)[1]
                self._entries[pattern] = (search, weight)
                self._bytes += weight
        return search


_REGEXES: Final = RegexCache(REGEX_CACHE_BYTES)


def regex(pattern: str) -> Search:
    """The compiled RE2 search for ``pattern``, shared through a bounded cache."""
    return _REGEXES.search(pattern)


def matches(text: str, pattern: str) -> bool:
    return regex(pattern)(text)


def starts_with(text: str, prefix: str) -> bool:
    return text.startswith(prefix)


def ends_with(text: str, suffix: str) -> bool:
    return text.endswith(suffix)


def contains_string(text: str, part: str) -> bool:
    return part in text


# -- conversions ---------------------------------------------------------------------

_INTEGER_TEXT: Final = re.compile(r"\s*([+-]?[0-9]+)\s*", re.ASCII)
_HEX_FLOAT_TEXT: Final = re.compile(r"\s*[+-]?0[xX][0-9a-fA-F.]+(?:[pP][+-]?[0-9]+)?\s*", re.ASCII)
_TWO_POW_63: Final = 9.223372036854775808e18
_TWO_POW_64: Final = 1.8446744073709551616e19
_TRUE_TEXT: Final = frozenset({"1", "t", "true", "TRUE", "True"})
_FALSE_TEXT: Final = frozenset({"0", "f", "false", "FALSE", "False"})


def naming(place: str, convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``convert`` with its errors prefixed by ``place``, the field it converts
    (``request.headers["x-tenant"]``): the error names where the value came from
    and its kind, never the value, which may be a credential."""

    def named(value: Any) -> Any:
        try:
            return convert(value)
        except CelEvalError as error:
            raise CelEvalError(f"{place}: {error}") from None

    return named


def int_from_uint(value: int) -> int:
    if value > INT64_MAX:
        raise CelEvalError("uint out of int range")
    return int(value)


def int_from_double(value: float) -> int:
    if not -_TWO_POW_63 < value < _TWO_POW_63:
        raise CelEvalError("double out of int range")
    return int(value)


def int_from_string(text: str) -> int:
    match = _INTEGER_TEXT.fullmatch(text)
    if match is None:
        raise CelEvalError("cannot convert string to int: not a decimal integer")
    value = int(match.group(1))
    if not INT64_MIN <= value <= INT64_MAX:
        raise CelEvalError("cannot convert string to int: out of range")
    return value


def int_from_timestamp(value: Timestamp) -> int:
    return value.nanos // NANOS_PER_SECOND


def uint_from_int(value: int) -> UInt:
    if value < 0:
        raise CelEvalError("int out of uint range")
    return UInt(value)


def uint_from_double(value: float) -> UInt:
    if not 0 <= value < _TWO_POW_64:
        raise CelEvalError("double out of uint range")
    return UInt(int(value))


def uint_from_string(text: str) -> UInt:
    match = _INTEGER_TEXT.fullmatch(text)
    if match is None or match.group(1).startswith("-"):
        raise CelEvalError("cannot convert string to uint: not a decimal integer >= 0")
    value = int(match.group(1))
    if value > UINT64_MAX:
        raise CelEvalError("cannot convert string to uint: out of range")
    return UInt(value)


def double_from_int(value: int) -> float:
    return float(value)


def double_from_string(text: str) -> float:
    if "_" in text:
        raise CelEvalError("cannot convert string to double: not a number")
    try:
        if _HEX_FLOAT_TEXT.fullmatch(text):
            return float.fromhex(text.strip())
        return float(text)
    except ValueError:
        raise CelEvalError("cannot convert string to double: not a number") from None


def format_double(value: float) -> str:
    """cel-cpp's ``string(double)``: shortest round-trip digits, ``%g`` layout
    (exponent form below 1e-4 and from 1e6 on)."""
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "-0" if math.copysign(1.0, value) < 0 else "0"
    sign, digit_tuple, exponent = Decimal(repr(value)).as_tuple()
    digits = "".join(map(str, digit_tuple)).rstrip("0")
    assert isinstance(exponent, int)
    exponent += len(digit_tuple) - len(digits)
    leading = len(digits) - 1 + exponent
    prefix = "-" if sign else ""
    if leading < -4 or leading >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{prefix}{mantissa}e{'+' if leading >= 0 else '-'}{abs(leading):02d}"
    if exponent >= 0:
        return prefix + digits + "0" * exponent
    if leading >= 0:
        return f"{prefix}{digits[: leading + 1]}.{digits[leading + 1 :]}"
    return f"{prefix}0.{'0' * (-leading - 1)}{digits}"


def string_from_bytes(value: bytes) -> str:
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise CelEvalError("invalid UTF-8 in bytes converted to string") from None


def string_from_bool(value: bool) -> str:
    return "true" if value else "false"


def string_from_int(value: int) -> str:
    return str(int(value))


def bytes_from_string(value: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise CelEvalError("string is not valid Unicode") from None


def bool_from_string(text: str) -> bool:
    if text in _TRUE_TEXT:
        return True
    if text in _FALSE_TEXT:
        return False
    raise CelEvalError("cannot convert string to bool: not true, false, t, f, 1 or 0")


def timestamp_from_int(seconds: int) -> Timestamp:
    return chrono.checked_timestamp(seconds * NANOS_PER_SECOND)


def identity(value: Any) -> Any:
    return value
