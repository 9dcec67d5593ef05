"""Holding a request on the serving path: flow control over the event loop (``Holding``).

An exchange whose policy has a ``flow`` section asks ``FlowControl``
(``policyd.flow``) on its request body. Held, it answers that message with a
``HeldReply``: the stream (``process_stream.py``) sends Envoy the message
that extends its timeout for this message (``override_message_timeout``, up
to the ``max_message_timeout`` policyd's Envoy configurations set), then
awaits the future until the request is dispatched (its routing reply) or
answered (an expired, evicted or shut-down request's error). Nothing blocks
the event loop: the stream's coroutine simply waits.

``Holding`` drives the flow control on the loop: a request ending on a pod
(``finished``) and a new pool snapshot are the signals that can make room,
and while anything is held a timer looks for a new snapshot and for the
next expiry every ``tick_seconds``. ``drain`` dispatches what it can within
a grace period on shutdown and answers the rest 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import duration_pb2

from policyd.extproc.interfaces import SnapshotSource
from policyd.extproc.usage import UsageReader
from policyd.flow import FlowAnswer, FlowControl, Held
from policyd.flow.control import AdmissionSource, FlowObserver
from policyd.policy.flow import HOLD_MARGIN_SECONDS, MAX_HOLD_SECONDS
from policyd.policy.request import Request

log = logging.getLogger("policyd.extproc")

TICK_SECONDS: Final = 0.02  # how often a held queue looks for a new snapshot and expiries
SHUTDOWN: Final = FlowAnswer(
    503, None, "flow_shutdown", "policyd is shutting down and no pod had room in time"
)


def timeout_extension(seconds: float) -> bytes:
    """The reply that asks Envoy to wait up to ``seconds`` for this message's answer."""
    seconds = min(seconds + HOLD_MARGIN_SECONDS, MAX_HOLD_SECONDS)
    whole = int(seconds)
    duration = duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    reply: bytes = pb.ProcessingResponse(override_message_timeout=duration).SerializeToString()
    return reply


class HeldReply:
    """The answer to a held request's message: first ``extension``, then, once
    ``result`` is done, the replies it resolves to."""

    __slots__ = ("extension", "result")

    def __init__(self, wait_seconds: float) -> None:
        self.extension = timeout_extension(wait_seconds)
        self.result: asyncio.Future[object] = asyncio.get_running_loop().create_future()

    def resolve(self, replies: object) -> None:
        if not self.result.done():
            self.result.set_result(replies)


@dataclass(frozen=True, slots=True)
class HeldRequest:
    """A held request: its pending reply, its place in the queue, what deciding it needs."""

    reply: HeldReply
    held: Held
    document: bytes
    trailers: bool
    since: float  # perf_counter when it was held
    # The request as admitted, the pool's objective and model rewrite applied: it
    # is dispatched as that, whatever those objects say by then.
    admitted: Request


class Holding:
    """One server's flow control on its event loop (see the module docstring)."""

    def __init__(
        self,
        routers: Callable[[], AdmissionSource],
        snapshots: SnapshotSource,
        observer: FlowObserver | None = None,
        *,
        tick_seconds: float = TICK_SECONDS,
    ) -> None:
        self.control = FlowControl(routers, snapshots, time.monotonic, observer)
        self._snapshots = snapshots
        self._tick = tick_seconds
        self._timer: asyncio.TimerHandle | None = None
        self._version: int | None = None

    def held(self) -> None:
        """Something is held: keep the timer going."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._tick, self._look)

    def finished(self, pod: str, key: object = None, usage: UsageReader | None = None) -> None:
        """A request ended on ``pod`` (``key``: its exchange): a slot may be free. The
        ``usage`` its pod reported teaches flow control what requests hold, if it was
        one under flow control (only then is the answer's usage decoded here)."""
        reported = None
        if usage is not None and self.control.flying(key):
            counted = usage.finish()
            if counted is not None:
                reported = (counted.prompt_tokens, counted.completion_tokens)
        self.control.finished(pod, key, reported)

    def _look(self) -> None:
        self._timer = None
        try:
            self.control.pump()  # new snapshot or not: expiries are due on time either way
        except Exception:
            # A failure outside any one request (the policy source, the snapshot) must
            # not stop the timer: held requests would then wait past their max_wait.
            log.exception("flow control's look at the pool failed; trying again next tick")
        if self.control.held:
            self.held()

    async def drain(self, grace_seconds: float) -> int:
        """Dispatch held requests as pods free up for ``grace_seconds``, then answer
        the rest 503; how many were answered so."""
        deadline = time.monotonic() + grace_seconds
        while self.control.held and time.monotonic() < deadline:
            self.control.pump()
            await asyncio.sleep(self._tick)
        answered = self.control.close(SHUTDOWN)
        if answered:
            log.warning("%d held request(s) answered 503 at shutdown", answered)
        return answered

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
