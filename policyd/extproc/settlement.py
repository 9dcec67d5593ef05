"""Requests' bookkeeping, done in batches a few milliseconds after their replies.

What policyd records about a request once a reply is out (the decision's
metrics, span attributes and shadow policies; the response's usage and
outcome) cannot change where that request goes, so it need not run the
moment the reply leaves. Run right then, one request at a time, it pays a
cold-cache price: between two ext_proc messages Envoy, the client and gRPC
run on the same cores and evict policyd's code and data, and the same
bookkeeping costs 3-5x its hot-loop time (``benchmarks/cold_cache.py``).
Queued and run a few milliseconds later, one request after another, only
the first of a batch finds the caches cold.

Only bookkeeping waits: the in-flight count of a pod drops the moment its
request ends, since routing reads it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final, Protocol

log = logging.getLogger("policyd.extproc")

DEFAULT_DELAY_SECONDS: Final = 0.005


class Settles(Protocol):
    def settle(self) -> None:
        """Do the queued bookkeeping; must not raise."""


class Settlement:
    """A queue of requests with bookkeeping due, emptied by a timer on the event loop.

    Used from the event loop only (no lock). Without a running loop (a caller
    driving an exchange directly) an item is settled at once.
    """

    def __init__(self, delay_seconds: float = DEFAULT_DELAY_SECONDS) -> None:
        self._delay = delay_seconds
        self._queue: list[Settles] = []
        self._timer: asyncio.TimerHandle | None = None

    def add(self, item: Settles) -> None:
        self._queue.append(item)
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(self._delay, self.flush)

    @property
    def idle(self) -> bool:
        """Nothing is waiting to be settled."""
        return not self._queue

    def flush(self) -> None:
        """Settle everything queued now (the timer's call, and at shutdown)."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        queue, self._queue = self._queue, []
        for item in queue:
            try:
                item.settle()
            except Exception:  # settle must not raise; if it does, the others still run
                log.exception("settling a request's bookkeeping failed")
