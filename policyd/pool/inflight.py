"""A pod's requests in flight and their prefill to come: they outlive the pool's snapshots."""

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
    # The uncached prompt tokens of the requests sent here that have not yet
    # answered a first token: the prefill queued ahead of the next one, which
    # no scraped figure shows (``running`` counts a long prefill as one
    # request). Added by the serving path as it routes, taken back exactly
    # once at the first body bytes, the end or the expiry, so it stays within
    # the prompt sizes of the requests in flight.
    prefill_tokens: int = 0
