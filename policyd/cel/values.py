"""Runtime representations of CEL values: plain Python wherever Python is exact.

A compiled program takes and returns these values (``Program.evaluate``):

=====================  ==========================================================
CEL type               Python value
=====================  ==========================================================
``bool``               ``bool``
``int``                ``int`` (an int64; arithmetic outside it is a CEL error)
``uint``               ``UInt`` (an ``int`` subclass, so ``UInt(1) == 1`` and both
                       hash alike, which is CEL's numeric equality; the class keeps
                       ``type(1u)`` and overloads apart). A plain ``int`` passed for a
                       variable *declared* ``uint`` is accepted as that uint.
``double``             ``float``
``string``             ``str`` (``size`` counts code points, as CEL does)
``bytes``              ``bytes``
``null_type``          ``None``
``list(T)``            any ``Sequence`` (``tuple`` or ``list``); results built by a
                       program are ``tuple`` or ``list``
``map(K, V)``          any ``Mapping`` (``dict`` in results)
``google.protobuf.Duration``   ``Duration``: signed nanoseconds
``google.protobuf.Timestamp``  ``Timestamp``: nanoseconds since the Unix epoch, UTC
``type``               ``CelType``: the type's CEL name (``int``, ``list``,
                       ``google.protobuf.Duration``, ``policyd.Pod``...)
messages               any object whose attributes are the message's fields
                       (``policyd.pool.pod.Pod``, ``policyd.policy.request.Request``)
=====================  ==========================================================

``datetime`` stops at microseconds and CEL durations and timestamps carry
nanoseconds, hence the two small value types. Map keys are ``bool``, ``int``,
``UInt`` or ``str``; one map cannot hold both ``true`` and ``1`` as keys because
Python's ``dict`` merges them (a program that builds such a map gets a CEL error
instead of a wrong map).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

NANOS_PER_SECOND: Final = 1_000_000_000

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
UINT64_MAX: Final = 2**64 - 1

# google.protobuf.Duration's range: +-10000 years, to the nanosecond.
DURATION_MAX_NANOS: Final = 315_576_000_000 * NANOS_PER_SECOND + 999_999_999
# google.protobuf.Timestamp's range: 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999999Z.
TIMESTAMP_MIN_NANOS: Final = -62_135_596_800 * NANOS_PER_SECOND
TIMESTAMP_MAX_NANOS: Final = 253_402_300_799 * NANOS_PER_SECOND + 999_999_999


class UInt(int):
    """A CEL ``uint`` (0 .. 2**64-1). Arithmetic on it returns plain ``int``;
    compiled programs re-wrap and range-check results themselves."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"UInt({int(self)})"


@dataclass(frozen=True, slots=True, order=True)
class Duration:
    """A CEL ``google.protobuf.Duration``: a signed count of nanoseconds."""

    nanos: int

    @classmethod
    def from_seconds(cls, seconds: float) -> Duration:
        return cls(round(seconds * NANOS_PER_SECOND))

    def seconds(self) -> float:
        return self.nanos / NANOS_PER_SECOND


@dataclass(frozen=True, slots=True, order=True)
class Timestamp:
    """A CEL ``google.protobuf.Timestamp``: nanoseconds since 1970-01-01T00:00:00Z."""

    nanos: int


@dataclass(frozen=True, slots=True)
class CelType:
    """A CEL type used as a value (``type(x)``, ``int``, ``google.protobuf.Duration``)."""

    name: str

    def __str__(self) -> str:
        return self.name


ZERO_DURATION: Final = Duration(0)

BOOL_TYPE: Final = CelType("bool")
INT_TYPE: Final = CelType("int")
UINT_TYPE: Final = CelType("uint")
DOUBLE_TYPE: Final = CelType("double")
STRING_TYPE: Final = CelType("string")
BYTES_TYPE: Final = CelType("bytes")
NULL_TYPE: Final = CelType("null_type")
LIST_TYPE: Final = CelType("list")
MAP_TYPE: Final = CelType("map")
TYPE_TYPE: Final = CelType("type")
DURATION_TYPE: Final = CelType("google.protobuf.Duration")
TIMESTAMP_TYPE: Final = CelType("google.protobuf.Timestamp")
