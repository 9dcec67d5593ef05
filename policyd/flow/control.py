"""Flow control: hold requests while the pool is saturated, dispatch them as pods free up.

``FlowControl`` sits in front of the router, for the policies that have a
``flow`` section (``policyd.policy.flow``). It knows no clock and no event
loop of its own: the serving path (``policyd.extproc``) and the simulator's
benchmark each drive it with their own time and tell it when something
changed.

- ``arrive(request, size, waiter)``: a request under flow control. While
  nothing of its policy is held and some pod has room, it is routed at once,
  over the pods with room (``Pass``). Otherwise it is queued and the queue
  pumped: it passes if it is dispatched right then, else it is held
  (``Held``), or refused at once when the queue is full and it is the one to go.
- ``pump()``: something changed (a request ended on a pod, a scrape round, a
  timer). Expired requests get the policy's answer; then, while some pod has
  room for the next request of the queue, that request is dispatched
  (``Waiter.dispatch``), one at a time.
- ``leave(held)``: the request's client went away.
- ``close()``: answer every held request (SIGTERM past the grace period).

Late binding and no herding: a held request is decided when it is
dispatched, on the snapshot of that moment, over only the pods with room for
it, under the policy current then (``Router.admission`` again: a reload
applies). Every request sent to a pod counts there at once: ``pod.in_flight``
is policyd's own live count, and ``pod.waiting_queue`` reads as scraped plus
the requests policyd sent to the pod since that scrape, less those that ended
there (``sent`` / ``finished``; reset by each new snapshot). So one freed
slot lets one request through, and a burst is never released on a stale
reading.

Pacing by KV cache, where the pod publishes its cache size
(``kv_cache_blocks`` x ``kv_block_size``): ``pod.kv_cache`` reads as the
scrape plus the footprint of the requests sent there that the scrape cannot
have seen yet (``unseen.py``: those of the last few snapshots), each counted
as its prompt plus half its ``max_tokens`` (what it holds on average over its
life). Both parts of a footprint are scaled by what the pods reported for
earlier requests (``footprint.py``): policyd's prompt count against the
model's tokenizer, and the output a budget really brings. Requests ending
take nothing off: the scrape says what left (a response's end can reach
policyd seconds after the pod finished it).

A request's output grows for seconds after its prompt took its blocks, so a
pool filled on the reading alone would overshoot once those requests grow.
For flows at or over their share the reading is therefore at least policyd's
own estimate: the footprints of the requests under flow control in flight on
the pod (``flight.py``), scaled down to the share of them the pod itself
still counts (its running and waiting requests, and the unseen ones): the
requests whose end policyd has not heard yet, though the pod finished them,
hold nothing there. A request whose flow has fewer requests in flight than
its weight's share of its policy's reads the scrape and the unseen requests
only: fresher, and lower while requests early in their life hold less than
the average the estimate counts. And a request that another could go before
(a higher band in flight, or another flow while its own is at or over its
share) leaves room on each pod for one average request. So a flood, or a
lower band, paced to the limit still leaves the small tenant's or the
critical request room at once.

A bound on the flows: a flow whose queue is empty goes first in its band's
turns when its request comes, and a flow with nothing in flight is under its
share, so a client that makes up a new key for every request would jump the
turns and the pacing each time. A request counts in its own flow (its key)
while its key holds requests or has them in flight, or while fewer than the
policy's ``max_flows`` flows do (counted once per band holding requests and
once more with requests in flight); past that it counts in the one overflow
flow (``OVERFLOW_FLOW``, weight 1), which joins the back of the turns and
takes its share like any other flow. Made-up keys so hold at most
``max_flows`` flows of their own at a time, each going first once: that
bounds the slots they take by jumping the turns, and the other slots go by
turns to the flows waiting and the overflow flow. A flow named under the
policy's ``weights`` always counts on its own: made-up keys cannot push a
configured tenant into the overflow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from policyd.flow.flight import Flight, weight_in
from policyd.flow.queue import OVERFLOW_FLOW, BandLimits, FlowQueue, Held, Limits
from policyd.flow.unseen import Unseen
from policyd.policy.flow import CompiledFlow
from policyd.policy.request import Request
from policyd.policy.router import Admission

log = logging.getLogger("policyd.flow")


@dataclass(frozen=True, slots=True)
class FlowAnswer:
    """What a request flow control will not dispatch gets: an HTTP error with a reason."""

    status: int  # 429 or 503 (the policy's); 500 when dispatching it failed
    retry_after_s: int | None
    code: str  # flow_expired, flow_evicted, flow_refused, flow_shutdown, flow_failed
    message: str


class Waiter(Protocol):
    """The request a held entry stands for, as its owner (an exchange) sees it."""

    def dispatch(self, candidates: Sequence[Any]) -> str | None:
        """Decide and send the request over ``candidates`` (the pods with room);
        the name of the pod it went to (None: not routed after all)."""
        ...

    def answer(self, answer: FlowAnswer) -> None:
        """Answer the request with ``answer`` instead: it leaves the queue."""
        ...


class Snapshot(Protocol):
    @property
    def version(self) -> int: ...
    @property
    def candidates(self) -> Sequence[Any]: ...


class AdmissionSource(Protocol):
    def admission(self, request: Request) -> Admission | None: ...


class FlowObserver(Protocol):
    """Where flow control reports (Prometheus: ``policyd.telemetry.metrics.FlowMetrics``)."""

    def held(self, band: str, flow: str, change: int, model: str) -> None: ...
    def outcome(self, band: str, flow: str, outcome: str, waited_s: float) -> None: ...


class _NoObserver:
    def held(self, band: str, flow: str, change: int, model: str) -> None:
        return None

    def outcome(self, band: str, flow: str, outcome: str, waited_s: float) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Pass:
    """Route the request now, over ``candidates`` (the pool's, or those of them with room)."""

    candidates: Sequence[Any]


@dataclass(frozen=True, slots=True)
class Entry:
    """What a held request carries: its request, its waiter, its policy and that
    policy's flow control as it was when the request came (for its answer)."""

    request: Request
    waiter: Waiter
    policy: str
    flow: CompiledFlow


class _Pending:
    """A pod with what policyd knows past its scrape laid over it: in its queue the
    requests sent there since the snapshot, less those that ended there (never below
    0); in its KV cache the ``unseen`` tokens sent there, at least ``estimate`` where
    given, and the ``reserve`` it keeps (see the module docstring)."""

    __slots__ = ("_pod", "kv_cache", "waiting_queue")

    def __init__(
        self,
        pod: Any,
        change: int,
        unseen: int = 0,
        estimate: float | None = None,
        reserve: float = 0.0,
    ) -> None:
        self._pod = pod
        self.waiting_queue = max(0, pod.waiting_queue + change)
        capacity = pod.kv_cache_blocks * pod.kv_block_size
        kv_cache: float = pod.kv_cache
        if capacity <= 0:
            self.kv_cache = kv_cache
            return
        kv_cache += unseen / capacity
        if estimate is not None:
            kv_cache = max(kv_cache, estimate / capacity)
        self.kv_cache = kv_cache + reserve / capacity

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pod, name)

    @property
    def pod(self) -> Any:
        return self._pod


def unwrap(pod: Any) -> Any:
    """The pool's own pod behind a candidate ``Pass`` or ``dispatch`` handed out."""
    return pod.pod if isinstance(pod, _Pending) else pod


class FlowControl:
    """Held requests per policy, and their dispatch (see the module docstring)."""

    def __init__(
        self,
        routers: Callable[[], AdmissionSource],
        snapshots: Callable[[], Snapshot],
        clock: Callable[[], float],
        observer: FlowObserver | None = None,
    ) -> None:
        self._routers = routers
        self._snapshots = snapshots
        self._clock = clock
        self._observer: FlowObserver = observer or _NoObserver()
        self._queues: dict[str, FlowQueue] = {}
        # pod name -> requests sent there less requests ended there since the snapshot
        self._sent: dict[str, int] = {}
        self._version: int | None = None
        self.flight = Flight()  # what is in flight under flow control, and where
        self.unseen = Unseen()  # what was sent to each pod that its scrape may not show
        # the last Pass (its waiter, admission and flow), until sent
        self._passed: tuple[object, Admission, str] | None = None
        self._arriving: Held | None = None  # the request ``arrive`` is pumping for
        self._arrived_room: Sequence[Any] | None = None  # the room pumping found for it
        self.held = 0  # over every queue
        self._pumping = False

    # -- arrivals ---------------------------------------------------------------------

    def arrive(
        self, admission: Admission, request: Request, size: int, waiter: Waiter
    ) -> Pass | Held | FlowAnswer:
        """A request under ``admission`` (``Router.admission``; not None): route it now
        (``Pass``), hold it (``Held``), or answer it at once (the queue is full)."""
        queue = self._queues.get(admission.policy)
        key = self._flow_key(admission, queue)
        snapshot = self._fresh()
        if not queue:
            room = self._room(admission, snapshot, key)
            if room:
                self._passed = (waiter, admission, key)
                return Pass(room)
        if queue is None:
            queue = self._queues[admission.policy] = FlowQueue()
        flow = admission.flow
        queue.limits = Limits(flow.max_requests, flow.max_body_bytes, flow.when_full == "evict")
        now = self._clock()
        band = admission.band
        held = Held(
            Entry(request, waiter, admission.policy, flow),
            BandLimits(
                band.name, band.rank, band.max_wait_s, band.max_requests, band.max_body_bytes
            ),
            key,
            weight=weight_in(admission, key),
            size=size,
            arrived=now,
            deadline=flow.deadline_of(admission.request, now, band)
            if flow.order == "deadline"
            else None,
        )
        admitted, evicted = queue.push(held)
        for victim in evicted:
            self._gone(victim, -1)
            self._answer(victim, "evicted", _EVICTED)
        if not admitted:
            self._observer.outcome(band.name, key, "refused", 0.0)
            return _answer(flow, "flow_refused", _REFUSED)
        self.held += 1
        self._observer.held(band.name, key, 1, request.model)
        # A pod may have room after all (the queue was not empty), maybe for this very
        # request: then it passes here, as its owner does not hold it yet.
        self._arriving = held
        try:
            self.pump()
        finally:
            self._arriving = None
        passing, self._arrived_room = self._arrived_room, None
        return held if passing is None else Pass(passing)

    def leave(self, held: Held) -> None:
        """The request's client went away: out of the queue at once."""
        queue = self._queue_of(held)
        if queue is not None and queue.remove(held):
            self._gone(held, -1)
            self._observer.outcome(held.band.name, held.flow, "abandoned", self._waited(held))

    def sent(self, pod: str, key: object = None) -> None:
        """A request under flow control went to ``pod`` (counted in its queue until the
        next snapshot). ``key`` is the waiter ``arrive`` was handed: the request that
        ``arrive`` just let ``Pass`` (decided and sent right after, with no await
        between) is then counted in flight until ``finished`` with the same key."""
        self._sent[pod] = self._sent.get(pod, 0) + 1
        passed = self._passed
        if passed is not None and key is not None and passed[0] is key:
            self._passed = None
            if pod:
                try:
                    self.unseen.sent(pod, self.flight.fly(key, pod, passed[1], passed[2]))
                except Exception:  # sent already: it goes uncounted rather than fail its caller
                    log.exception("flow control failed to count a request in flight")

    def flying(self, key: object) -> bool:
        """Whether the request of ``key`` is in flight under flow control."""
        return key in self.flight

    def finished(
        self, pod: str, key: object = None, reported: tuple[int, int] | None = None
    ) -> None:
        """A request ended on ``pod``: one fewer there since its scrape (and, by its
        ``key``, no longer in flight); dispatch what fits. ``reported``: the prompt and
        completion tokens the pod counted for it, where it said."""
        self._sent[pod] = self._sent.get(pod, 0) - 1
        if key is not None and self.flight:
            try:
                request = self.flight.land(key)
                if request is not None and reported is not None:
                    footprint = self.flight.footprint
                    footprint.learn(request.prompt_tokens, request.max_tokens, *reported)
            except Exception:  # the end of one request stops nothing else
                log.exception("flow control failed to count a request's end")
        self.pump()

    # -- dispatch ---------------------------------------------------------------------

    def pump(self) -> None:
        """Answer the expired, then dispatch while a pod has room for the next request."""
        if self._pumping or not self.held:
            return  # a dispatch that ends a request at once calls back: one pump at a time
        self._pumping = True
        try:
            now = self._clock()
            for queue in self._queues.values():
                for held in queue.expire(now):
                    self._gone(held, -1)
                    self._answer(held, "expired", _EXPIRED)
            for queue in self._queues.values():
                self._dispatch(queue)
        finally:
            self._pumping = False

    def _dispatch(self, queue: FlowQueue) -> None:
        """Dispatch while a pod has room. A request that raises on the way fails alone:
        it is logged and answered 500, and the queue goes on with the next."""
        routers = self._routers()
        while queue:
            held = queue.pop()
            if held is None:
                return
            entry: Entry = held.payload
            try:
                snapshot = self._fresh()
                admission = routers.admission(entry.request)
                # None: reloaded without flow control, routed as it comes
                room = (
                    snapshot.candidates
                    if admission is None
                    else self._room(admission, snapshot, held.flow)
                )
            except Exception:
                log.exception("a held request failed before dispatch")
                self._gone(held, -1)
                self._answer(held, "failed", _FAILED, status=500)
                continue
            if not room:
                queue.unpop(held)
                return
            self._gone(held, -1)
            self._observer.outcome(held.band.name, held.flow, "dispatched", self._waited(held))
            if held is self._arriving:  # ``arrive`` lets it pass: the rest at the next signal
                self._arrived_room = room
                if admission is not None:
                    self._passed = (entry.waiter, admission, held.flow)
                return
            try:
                pod = entry.waiter.dispatch(room)
                if pod is not None:
                    self.sent(pod)
                    if admission is not None:
                        tokens = self.flight.fly(entry.waiter, pod, admission, held.flow)
                        self.unseen.sent(pod, tokens)
            except Exception:
                log.exception("a held request failed at dispatch")
                self._reply(entry, _answer(entry.flow, "flow_failed", _FAILED, status=500))

    @property
    def held_bytes(self) -> int:
        """The body bytes held, over every queue."""
        return sum(queue.bytes for queue in self._queues.values())

    def next_expiry(self) -> float | None:
        """When the next held request expires (None: nothing held)."""
        times = [t for q in self._queues.values() if (t := q.next_expiry()) is not None]
        return min(times) if times else None

    def close(self, answer: FlowAnswer) -> int:
        """Answer every held request with ``answer``; how many there were."""
        count = 0
        for queue in self._queues.values():
            for held in list(queue):
                queue.remove(held)
                self._gone(held, -1)
                self._observer.outcome(held.band.name, held.flow, "refused", self._waited(held))
                count += 1
                try:
                    held.payload.waiter.answer(answer)
                except Exception:
                    log.exception("a held request failed to be answered")
        return count

    # -- the pods with room -----------------------------------------------------------

    def _fresh(self) -> Snapshot:
        snapshot = self._snapshots()
        if snapshot.version != self._version:
            self._version = snapshot.version
            self._sent.clear()  # the new scrape saw them
            self.unseen.snapshot_came(snapshot.version)
        return snapshot

    def _flow_key(self, admission: Admission, queue: FlowQueue | None) -> str:
        """The flow the request counts in: its key, or past ``max_flows`` the overflow
        flow (see the module docstring)."""
        key = admission.key
        flow = admission.flow
        policy = admission.policy
        flight = self.flight
        if key in flow.weights or flight.carries(policy, key):
            return key
        held = 0
        if queue is not None:
            if queue.holds(key):
                return key
            held = queue.flows()
        return key if held + flight.flows(policy) < flow.max_flows else OVERFLOW_FLOW

    def _room(self, admission: Admission, snapshot: Snapshot, flow: str) -> Sequence[Any]:
        """The pods with room for the request (the snapshot's own tuple when all have)."""
        candidates = snapshot.candidates
        sent = self._sent
        flight = self.flight
        unseen = self.unseen
        if flight.tokens or unseen:
            under, reserving = flight.standing(admission, flow)
            reserve = flight.reserve if reserving else 0.0
            seen = [
                _Pending(
                    pod,
                    sent.get(pod.name, 0),
                    unseen.tokens.get(pod.name, 0),
                    None if under else self._estimate(pod),
                    reserve,
                )
                for pod in candidates
            ]
            return admission.room(seen)
        if sent:
            seen = [
                _Pending(pod, count) if (count := sent.get(pod.name)) else pod for pod in candidates
            ]
            return admission.room(seen)
        room = admission.room(candidates)
        return candidates if len(room) == len(candidates) else room

    def _estimate(self, pod: Any) -> float:
        """The tokens the requests under flow control in flight on ``pod`` hold, scaled
        down to the share of them the pod counts (see the module docstring)."""
        name = pod.name
        tokens = self.flight.tokens.get(name, 0)
        if not tokens:
            return 0.0
        there: int = pod.running + pod.waiting_queue + self.unseen.count.get(name, 0)
        return tokens * min(1.0, there / self.flight.counts[name])

    # -- bookkeeping ------------------------------------------------------------------

    def _queue_of(self, held: Held) -> FlowQueue | None:
        return self._queues.get(held.payload.policy)

    def _gone(self, held: Held, change: int) -> None:
        self.held += change
        self._observer.held(held.band.name, held.flow, change, held.payload.request.model)

    def _waited(self, held: Held) -> float:
        return max(0.0, self._clock() - held.arrived)

    def _answer(self, held: Held, outcome: str, message: str, status: int | None = None) -> None:
        self._observer.outcome(held.band.name, held.flow, outcome, self._waited(held))
        entry: Entry = held.payload
        self._reply(entry, _answer(entry.flow, f"flow_{outcome}", message, status))

    @staticmethod
    def _reply(entry: Entry, answer: FlowAnswer) -> None:
        try:
            entry.waiter.answer(answer)
        except Exception:
            log.exception("a held request failed to be answered")


_EVICTED: Final = "evicted from the flow-control queue for a request of higher priority"
_REFUSED: Final = "the flow-control queue is full"
_EXPIRED: Final = "held past the maximum wait of its band: no pod had room for it"
_FAILED: Final = "flow control failed to dispatch the request"


def _answer(flow: CompiledFlow, code: str, message: str, status: int | None = None) -> FlowAnswer:
    """The policy's answer (``status`` instead: a failure of policyd's own, no retry)."""
    if status is not None:
        return FlowAnswer(status, None, code, message)
    retry = flow.retry_after_s if flow.status == 429 else None
    return FlowAnswer(flow.status, retry, code, message)
