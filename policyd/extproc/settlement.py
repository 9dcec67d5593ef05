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
request ends, since routing reads it. What is due, and when, is the
exchange's to say (``Exchange``, the one owner of a request's end, queues a
request's decision record once its reply is out and its end record once the
exchange ended); this queue only runs what it is given, in the order given.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

log = logging.getLogger("policyd.extproc")

DEFAULT_DELAY_SECONDS: Final = 0.005


Work = Callable[[], None]
"""One piece of bookkeeping; it should not raise (one that does is logged)."""


class Settlement:
    """A queue of bookkeeping due, run in order by a timer on the event loop.

    Used from the event loop only (no lock). Without a running loop (a caller
    driving an exchange directly) the work is done at once.
    """

    def __init__(self, delay_seconds: float = DEFAULT_DELAY_SECONDS) -> None:
        self._delay = delay_seconds
        self._queue: list[Work] = []
        self._timer: asyncio.TimerHandle | None = None

    def add(self, work: Work) -> None:
        self._queue.append(work)
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
        """Do everything queued now, in order (the timer's call, and at shutdown)."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        queue, self._queue = self._queue, []
        for work in queue:
            try:
                work()
            except Exception:  # work must not raise; if it does, the rest still runs
                log.exception("settling a request's bookkeeping failed")
