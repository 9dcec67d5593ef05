"""CEL timestamps and durations: parsing, formatting, calendar fields, time zones.

Everything is integer nanoseconds (``values.Timestamp`` / ``values.Duration``),
so nothing rounds through ``float`` or stops at ``datetime``'s microseconds.
The calendar is computed arithmetically (proleptic Gregorian, days since the
epoch), which covers CEL's whole timestamp range (years 1..9999) and time zone
offsets beyond what ``datetime.timezone`` accepts. Formats follow cel-cpp, the
reference evaluator policyd checks against: RFC 3339 with 0, 3, 6 or 9
fractional digits, durations as seconds with an ``s`` suffix.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from functools import lru_cache
from typing import Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from policyd.cel.errors import CelEvalError
from policyd.cel.values import (
    DURATION_MAX_NANOS,
    INT64_MAX,
    INT64_MIN,
    NANOS_PER_SECOND,
    TIMESTAMP_MAX_NANOS,
    TIMESTAMP_MIN_NANOS,
    Duration,
    Timestamp,
)

SECONDS_PER_DAY: Final = 86_400
NANOS_PER_MINUTE: Final = 60 * NANOS_PER_SECOND
NANOS_PER_HOUR: Final = 3_600 * NANOS_PER_SECOND
NANOS_PER_MILLISECOND: Final = 1_000_000

_TIMESTAMP_TEXT: Final = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))",
    re.ASCII,
)
_DURATION_PART: Final = re.compile(r"(\d*)(?:\.(\d*))?(ns|us|ms|s|m|h)", re.ASCII)
_UNIT_NANOS: Final = {
    "ns": 1,
    "us": 1_000,
    "ms": NANOS_PER_MILLISECOND,
    "s": NANOS_PER_SECOND,
    "m": NANOS_PER_MINUTE,
    "h": NANOS_PER_HOUR,
}
_FIXED_OFFSET: Final = re.compile(r"([+-]?)(\d{2}):(\d{2})", re.ASCII)


# -- ranges -------------------------------------------------------------------


def checked_timestamp(nanos: int) -> Timestamp:
    if not TIMESTAMP_MIN_NANOS <= nanos <= TIMESTAMP_MAX_NANOS:
        raise CelEvalError("timestamp out of range (years 0001..9999)")
    return Timestamp(nanos)


def checked_duration(nanos: int) -> Duration:
    if not -DURATION_MAX_NANOS <= nanos <= DURATION_MAX_NANOS:
        raise CelEvalError("duration out of range (+-10000 years)")
    return Duration(nanos)


def arithmetic_duration(nanos: int) -> Duration:
    """A duration computed by arithmetic: like cel-cpp and cel-go, the result
    must fit a signed 64-bit count of nanoseconds (about +-292 years)."""
    if not INT64_MIN <= nanos <= INT64_MAX:
        raise CelEvalError("duration arithmetic overflow (beyond +-292 years)")
    return checked_duration(nanos)


# -- civil calendar -----------------------------------------------------------


def days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date."""
    year -= month <= 2
    era = year // 400
    year_of_era = year - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146_097 + day_of_era - 719_468


def civil_from_days(days: int) -> tuple[int, int, int]:
    """(year, month 1..12, day 1..31) of a day count since 1970-01-01."""
    days += 719_468
    era = days // 146_097
    day_of_era = days - era * 146_097
    year_of_era = (
        day_of_era - day_of_era // 1_460 + day_of_era // 36_524 - day_of_era // 146_096
    ) // 365
    day_of_year = day_of_era - (365 * year_of_era + year_of_era // 4 - year_of_era // 100)
    shifted_month = (5 * day_of_year + 2) // 153
    day = day_of_year - (153 * shifted_month + 2) // 5 + 1
    month = shifted_month + (3 if shifted_month < 10 else -9)
    return year_of_era + era * 400 + (month <= 2), month, day


def _is_leap(year: int) -> bool:
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def _days_in_month(year: int, month: int) -> int:
    if month == 2:
        return 29 if _is_leap(year) else 28
    return 30 if month in (4, 6, 9, 11) else 31


# -- parsing and formatting ---------------------------------------------------


def parse_timestamp(text: str) -> Timestamp:
    """RFC 3339 (``2009-02-13T23:31:30.5Z``, ``...+01:00``) to a Timestamp."""
    match = _TIMESTAMP_TEXT.fullmatch(text)
    if match is None:
        raise CelEvalError("cannot convert string to timestamp: not RFC 3339")
    year, month, day, hour, minute, second = (int(match.group(i)) for i in range(1, 7))
    if not (
        1 <= month <= 12
        and 1 <= day <= _days_in_month(year, month)
        and hour <= 23
        and minute <= 59
        and second <= 60
    ):
        raise CelEvalError("cannot convert string to timestamp: no such date or time")
    fraction = (match.group(7) or "")[:9]
    nanos = int(fraction.ljust(9, "0")) if fraction else 0
    offset_seconds = 0
    if match.group(8) is None:
        offset_seconds = int(match.group(10)) * 3_600 + int(match.group(11)) * 60
        if match.group(9) == "-":
            offset_seconds = -offset_seconds
    seconds = (
        days_from_civil(year, month, day) * SECONDS_PER_DAY
        + hour * 3_600
        + minute * 60
        + second
        - offset_seconds
    )
    return checked_timestamp(seconds * NANOS_PER_SECOND + nanos)


def _fraction(nanos: int) -> str:
    """Protobuf JSON style: no digits, or 3, 6 or 9 of them."""
    if nanos == 0:
        return ""
    if nanos % 1_000_000 == 0:
        return f".{nanos // 1_000_000:03d}"
    if nanos % 1_000 == 0:
        return f".{nanos // 1_000:06d}"
    return f".{nanos:09d}"


def format_timestamp(value: Timestamp) -> str:
    seconds, nanos = divmod(value.nanos, NANOS_PER_SECOND)
    days, second_of_day = divmod(seconds, SECONDS_PER_DAY)
    year, month, day = civil_from_days(days)
    hour, rest = divmod(second_of_day, 3_600)
    minute, second = divmod(rest, 60)
    return (
        f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}{_fraction(nanos)}Z"
    )


def parse_duration(text: str) -> Duration:
    """Go-style durations: ``1h30m``, ``-1.5s``, ``300ms``, ``0``."""
    body = text[1:] if text[:1] in ("+", "-") else text
    if body == "0":
        return Duration(0)
    total = 0
    position = 0
    while position < len(body):
        match = _DURATION_PART.match(body, position)
        if match is None or (not match.group(1) and not match.group(2)):
            raise CelEvalError(
                "cannot convert string to duration: not a duration such as 1h30m or 0.5s"
            )
        unit = _UNIT_NANOS[match.group(3)]
        fraction = match.group(2) or ""
        total += int(match.group(1) or "0") * unit
        if fraction:
            total += int(fraction) * unit // 10 ** len(fraction)
        position = match.end()
    if position == 0:
        raise CelEvalError(
            "cannot convert string to duration: not a duration such as 1h30m or 0.5s"
        )
    return checked_duration(-total if text[:1] == "-" else total)


def format_duration(value: Duration) -> str:
    sign = "-" if value.nanos < 0 else ""
    seconds, nanos = divmod(abs(value.nanos), NANOS_PER_SECOND)
    return f"{sign}{seconds}{_fraction(nanos)}s"


# -- calendar fields ----------------------------------------------------------


@lru_cache(maxsize=256)
def _zone(name: str) -> ZoneInfo | None:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        return None


def _offset_seconds(zone: str, utc_seconds: int) -> int:
    """The UTC offset of ``zone`` (``+05:30``, ``-02:00``, ``UTC``, an IANA name)."""
    fixed = _FIXED_OFFSET.fullmatch(zone)
    if fixed is not None:
        offset = int(fixed.group(2)) * 3_600 + int(fixed.group(3)) * 60
        return -offset if fixed.group(1) == "-" else offset
    info = _zone(zone)
    if info is None:
        raise CelEvalError("invalid time zone: not an IANA name or a [+-]HH:MM offset")
    instant = datetime.fromtimestamp(utc_seconds, tz=UTC)
    delta = info.utcoffset(instant)
    return 0 if delta is None else int(delta.total_seconds())


def local_fields(value: Timestamp, zone: str | None) -> tuple[int, int, int, int, int]:
    """(days since epoch, year, month, day, second of day) in ``zone`` (UTC if None)."""
    seconds = value.nanos // NANOS_PER_SECOND
    if zone is not None:
        seconds += _offset_seconds(zone, seconds)
    days, second_of_day = divmod(seconds, SECONDS_PER_DAY)
    year, month, day = civil_from_days(days)
    return days, year, month, day, second_of_day


def full_year(value: Timestamp, zone: str | None = None) -> int:
    return local_fields(value, zone)[1]


def month_zero_based(value: Timestamp, zone: str | None = None) -> int:
    return local_fields(value, zone)[2] - 1


def day_of_month_one_based(value: Timestamp, zone: str | None = None) -> int:
    return local_fields(value, zone)[3]


def day_of_month_zero_based(value: Timestamp, zone: str | None = None) -> int:
    return local_fields(value, zone)[3] - 1


def day_of_week(value: Timestamp, zone: str | None = None) -> int:
    """0 is Sunday; 1970-01-01 was a Thursday."""
    return (local_fields(value, zone)[0] + 4) % 7


def day_of_year(value: Timestamp, zone: str | None = None) -> int:
    days, year, _, _, _ = local_fields(value, zone)
    return days - days_from_civil(year, 1, 1)


def hours(value: Timestamp, zone: str | None = None) -> int:
    return local_fields(value, zone)[4] // 3_600


def minutes(value: Timestamp, zone: str | None = None) -> int:
    return local_fields(value, zone)[4] // 60 % 60


def seconds(value: Timestamp, zone: str | None = None) -> int:
    return local_fields(value, zone)[4] % 60


def milliseconds(value: Timestamp, zone: str | None = None) -> int:
    if zone is not None:
        local_fields(value, zone)  # no zone shifts milliseconds, but a bad one is an error
    return value.nanos % NANOS_PER_SECOND // NANOS_PER_MILLISECOND


def _truncating_div(nanos: int, unit: int) -> int:
    quotient = abs(nanos) // unit
    return -quotient if nanos < 0 else quotient


def duration_hours(value: Duration) -> int:
    return _truncating_div(value.nanos, NANOS_PER_HOUR)


def duration_minutes(value: Duration) -> int:
    return _truncating_div(value.nanos, NANOS_PER_MINUTE)


def duration_seconds(value: Duration) -> int:
    return _truncating_div(value.nanos, NANOS_PER_SECOND)


def duration_milliseconds(value: Duration) -> int:
    """The millisecond *part* (as cel-cpp and the conformance suite define it)."""
    part = abs(value.nanos) % NANOS_PER_SECOND // NANOS_PER_MILLISECOND
    return -part if value.nanos < 0 else part
