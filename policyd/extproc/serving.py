"""What a server shares among its exchanges: settings, budgets, the response watch.

An ``Exchange`` (``exchange.py``) is one request; everything here is built
once per server (``process_stream.ExternalProcessor``) and read by every
exchange through ``ServingContext``.

Memory is bounded per request and per server (``ServingSettings``): a request
whose header block, path, body or model name is over its limit gets a
413/414/431/400 before anything is built from it, and the request-body bytes
a server holds at once are capped (``BodyBudget``; a 429 with
``Retry-After`` past it), reserved from the ``content-length`` at the
headers phase, before Envoy sends the body (``budget``), and a body's JSON
is bounded before it is parsed (``body_limits``). A routed request that sees no
response headers within ``in_flight_expiry_seconds`` stops counting in its
pod's in-flight (``ResponseWatch``), so streams that never reach a response
cannot steer ``pod.in_flight`` for long.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Protocol

from policyd.extproc import epp, replies
from policyd.extproc.budget import BODY_WAIT_SECONDS, BodyBudget, ByteBudget
from policyd.extproc.holding import Holding
from policyd.extproc.interfaces import RouterSource, SnapshotSource, Telemetry
from policyd.extproc.objectives import ObjectsSource
from policyd.extproc.openai import MAX_MODEL_BYTES
from policyd.extproc.settlement import Settlement
from policyd.prefix.probe import PrefixLocator

log = logging.getLogger("policyd.extproc")


@dataclass(frozen=True, slots=True)
class ServingSettings:
    """Per-server knobs of the request path.

    ``send_fallbacks`` puts the decision's fallbacks after the chosen endpoint
    (``a:1,b:2``) as the endpoint-picker protocol allows; enable it only when
    Envoy's cluster understands a list (the override-host load-balancing
    policy). An ORIGINAL_DST cluster, which ``policyd envoy-config``
    generates, takes exactly one ``ip:port`` and fails on a list.
    """

    send_fallbacks: bool = False
    # One request body (413 past it; Envoy's own buffer limit is 4 MiB by default).
    max_body_bytes: int = 16 * 1024 * 1024
    # Request-body bytes held at once over all of a server's exchanges (429 past it).
    max_buffered_body_bytes: int = 64 * 1024 * 1024
    # The request-headers message, all headers with names (431 past it; Envoy's
    # own limit is 60 KiB by default), and the path without its query (414).
    max_header_bytes: int = 64 * 1024
    max_path_bytes: int = 2048
    # A body reservation lapses this long after its headers if the bytes are needed.
    body_wait_seconds: float = BODY_WAIT_SECONDS
    # Response bytes all exchanges keep for usage (past it a response is not read).
    max_usage_bytes: int = 16 * 1024 * 1024
    # The body's model name (400 past it): no real model name is longer.
    max_model_bytes: int = MAX_MODEL_BYTES
    # A routed request with no response headers after this long stops counting
    # in its pod's in-flight (0: never). Above Envoy's stream idle timeout
    # (300 s in the generated config), after which no response can come.
    in_flight_expiry_seconds: float = 330.0
    # Where a split request names its prefill pod for the decode pod's sidecar.
    prefill_header: str = replies.PREFILL_HEADER

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0 or self.max_buffered_body_bytes < self.max_body_bytes:
            raise ValueError(
                "the body limits must be positive, and the buffered total at least one body"
            )
        if self.in_flight_expiry_seconds < 0 or self.body_wait_seconds < 0:
            raise ValueError("in_flight_expiry_seconds and body_wait_seconds must not be negative")
        if not replies.is_header_name(self.prefill_header):
            raise ValueError(f"{self.prefill_header!r} is not a lower-case HTTP header name")
        if self.prefill_header == replies.DESTINATION_HEADER:
            raise ValueError(f"the prefill header cannot be {replies.DESTINATION_HEADER}")


class Watched(Protocol):
    """A routed exchange (``policyd.extproc.exchange.Exchange``) as the watch sees it."""

    @property
    def routed_at(self) -> float:
        """When the request was decided (``time.perf_counter``)."""
        ...

    def expire(self) -> bool:
        """Stop counting in the pod's in-flight; whether the count was released."""
        ...


class ResponseWatch:
    """Routed exchanges still waiting for response headers, oldest first.

    An exchange past ``seconds`` without response headers is released from
    its pod's in-flight count (``Exchange.expire``): an ext_proc stream held
    open without a response (a client of the gRPC port that never sends
    one, an upstream that never answers) must not steer ``pod.in_flight``
    forever. Checked on a timer every tenth of ``seconds`` (at most every
    5 s) while anything waits: a set, whose adding and removing per request
    cost less than keeping the exchanges in order, walked whole by the timer.
    """

    __slots__ = ("_loopless", "_timer", "_waiting", "expired", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expired = 0
        self._waiting: set[Watched] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._loopless = False  # driven without an event loop (a benchmark): no expiry

    def __len__(self) -> int:
        return len(self._waiting)

    def watch(self, exchange: Watched) -> bool:
        """Start watching ``exchange`` (just routed); whether it is."""
        if self.seconds <= 0:
            return False
        self._waiting.add(exchange)
        if self._timer is None and not self._loopless:
            self._schedule()
        return True

    def forget(self, exchange: Watched) -> None:
        self._waiting.discard(exchange)

    def _schedule(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loopless = True
            return
        interval = min(max(self.seconds / 10, 0.01), 5.0)
        self._timer = loop.call_later(interval, self.sweep)

    def sweep(self) -> None:
        """Release the exchanges past their time; run by the timer."""
        self._timer = None
        waiting = self._waiting
        due = time.perf_counter() - self.seconds
        released = 0
        for exchange in [e for e in waiting if e.routed_at <= due]:
            waiting.discard(exchange)
            if exchange.expire():
                released += 1
        if released:
            self.expired += released
            log.warning(
                "%d routed request(s) saw no response headers within %.0f s: "
                "no longer counted in their pods' in-flight",
                released,
                self.seconds,
            )
        if waiting:
            self._schedule()


class ServingContext(Protocol):
    """What an exchange reads of its server (``ExternalProcessor``)."""

    @property
    def routers(self) -> RouterSource: ...
    @property
    def snapshots(self) -> SnapshotSource: ...
    @property
    def telemetry(self) -> Telemetry: ...
    @property
    def settings(self) -> ServingSettings: ...
    @property
    def route_replies(self) -> replies.RouteReplies: ...
    @property
    def settlement(self) -> Settlement: ...
    @property
    def rng(self) -> random.Random: ...
    @property
    def body_budget(self) -> BodyBudget: ...
    @property
    def usage_budget(self) -> ByteBudget: ...
    @property
    def response_watch(self) -> ResponseWatch: ...
    @property
    def subsets(self) -> epp.Subsets: ...
    @property
    def prefix(self) -> PrefixLocator | None: ...
    @property
    def holding(self) -> Holding: ...
    @property
    def objects(self) -> ObjectsSource: ...
