"""Runtime representations of CEL values that Python has no exact type for.

CEL durations and timestamps carry nanoseconds; ``datetime`` stops at
microseconds, so they get small value types of their own. Everything else maps
onto plain Python: int, float, bool, str, bytes, None, list/tuple, dict.
"""

from __future__ import annotations

from dataclasses import dataclass

NANOS_PER_SECOND = 1_000_000_000


@dataclass(frozen=True, slots=True, order=True)
class Duration:
    """A CEL ``google.protobuf.Duration``: a signed count of nanoseconds."""

    nanos: int

    @classmethod
    def from_seconds(cls, seconds: float) -> Duration:
        return cls(round(seconds * NANOS_PER_SECOND))

    def seconds(self) -> float:
        return self.nanos / NANOS_PER_SECOND


ZERO_DURATION = Duration(0)
