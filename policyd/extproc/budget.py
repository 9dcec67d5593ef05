"""Bytes a server's exchanges hold at once: request bodies (``BodyBudget``) and the
parts of responses kept for their usage (``ByteBudget``).

Both are used from the event loop only (no lock). An OOM kill takes every
open stream with it, so what peers send is held only against these limits,
and past them a request gets a 429 (bodies) or a response is not read for
usage (responses), never more memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final, Protocol

# How long a body may take to come after its headers and keep its reservation
# while another request needs the bytes (``BodyBudget``).
BODY_WAIT_SECONDS: Final = 5.0
# The part of the body budget that reservations may take (``BodyBudget``).
RESERVED_SHARE: Final = 0.5


class ByteBudget:
    """Bytes held against ``limit``; ``refused`` counts the takes that did not fit."""

    __slots__ = ("held", "limit", "refused")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.refused = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            self.refused += 1
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class Reserver(Protocol):
    """An exchange that reserved body bytes before its body came."""

    def lapse(self) -> int:
        """Give up the reservation of what has not come; the bytes given up."""
        ...


class BodyBudget:
    """The request-body bytes a server's exchanges hold at once, against a limit.

    An exchange reserves the body's ``content-length`` at the headers phase
    (the body is on its way, and gRPC will hold it), tops it up as more
    arrives, and gives it all back once the request is routed or answered.
    A reservation is a promise that costs its sender nothing: a stream can
    send headers and never its body. So reservations take at most
    ``RESERVED_SHARE`` of the limit (past it a request is let through
    unreserved and its body is counted when it comes), and one whose body
    has not come within ``wait_seconds`` lapses when another request needs
    the bytes, oldest first: the stalled exchange keeps what has arrived and
    takes the rest again when it comes, a 429 then if it no longer fits.
    Header-only streams can so never make a server refuse bodies it has
    room for.
    """

    __slots__ = (
        "_clock",
        "_reservations",
        "held",
        "lapsed",
        "limit",
        "refused",
        "reserved",
        "wait_seconds",
    )

    def __init__(
        self,
        limit: int,
        wait_seconds: float = BODY_WAIT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.wait_seconds = wait_seconds
        self.held = 0  # bodies in hand and reservations
        self.reserved = 0  # of which reservations
        self.refused = 0
        self.lapsed = 0  # reservations given up because their bodies stalled
        self._clock = clock
        # Each reservation's time and bytes, oldest first.
        self._reservations: dict[Reserver, tuple[float, int]] = {}

    def take(self, size: int) -> bool:
        """Hold ``size`` more bytes that have arrived; whether they fit (after
        stalled reservations lapse)."""
        if not self._fits(size):
            return False
        self.held += size
        return True

    def reserve(self, reserver: Reserver, size: int) -> int | None:
        """Reserve ``size`` bytes for ``reserver``'s body, still to come: the bytes
        reserved (0: the share for reservations is taken; its body is counted when
        it comes), or None when the server has no room for them at all."""
        if not self._fits(size):
            return None
        if self.reserved + size > self.limit * RESERVED_SHARE:
            return 0
        self.held += size
        self.reserved += size
        self._reservations[reserver] = (self._clock(), size)
        return size

    def arrived(self, reserver: Reserver) -> None:
        """``reserver``'s whole body is in: its bytes are held, no longer reserved."""
        reservation = self._reservations.pop(reserver, None)
        if reservation is not None:
            self.reserved -= reservation[1]

    def give(self, size: int, reserver: Reserver) -> None:
        self.held -= size
        self.arrived(reserver)

    def _fits(self, size: int) -> bool:
        over = self.held + size - self.limit
        if over > 0 and self._lapse(over) < over:
            self.refused += 1
            return False
        return True

    def _lapse(self, needed: int) -> int:
        """Let reservations older than ``wait_seconds`` lapse, oldest first, until
        ``needed`` bytes are free; the bytes freed."""
        due = self._clock() - self.wait_seconds
        reservations = self._reservations
        freed = 0
        while freed < needed and reservations:
            reserver, (since, size) = next(iter(reservations.items()))
            if since > due:
                break
            del reservations[reserver]
            self.reserved -= size
            gone = reserver.lapse()
            self.held -= gone
            freed += gone
            self.lapsed += 1
        return freed
