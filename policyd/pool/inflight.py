"""A pod's count of requests in flight, which outlives the pool's snapshots."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class InFlight:
    """Requests policyd sent to one pod that have not finished yet.

    Mutated only from the event loop (request start / end) and read by policies
    through ``Pod.in_flight``; it lives outside the immutable snapshot so a
    request starting does not force a new snapshot of every pod.
    """

    count: int = 0
