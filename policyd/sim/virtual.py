"""Virtual time: engines driven by a discrete-event loop, no sockets, no sleeping.

A ``VirtualLoop`` jumps from one scheduled event to the next, so a pool of pods
simulates thousands of seconds per wall-clock second. A ``VirtualPod`` is the
same ``Engine`` the HTTP servers run, driven step by step on that loop.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count

from policyd.sim.engine import Engine, EngineSnapshot, RequestState, SimRequest
from policyd.sim.engine_v1 import new_engine
from policyd.sim.profile import Profile


class Timer:
    """A scheduled callback; ``cancel`` makes the loop skip it."""

    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualLoop:
    """Runs callbacks in time order; ties run in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Timer]] = []
        self._order = count()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        if when < self.now:
            raise ValueError(f"cannot schedule at {when} s, the loop is at {self.now} s")
        timer = Timer(when, callback)
        heapq.heappush(self._queue, (when, next(self._order), timer))
        return timer

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return self.call_at(self.now + delay, callback)

    def run(self, until: float | None = None) -> None:
        """Run events until none is left (or the next is later than ``until``)."""
        queue = self._queue
        while queue:
            when, _, timer = queue[0]
            if until is not None and when > until:
                self.now = until
                return
            heapq.heappop(queue)
            if timer.cancelled:
                continue
            self.now = when
            timer.callback()


class VirtualPod:
    """One simulated model server on a virtual loop: submit, abort, read its state."""

    def __init__(self, loop: VirtualLoop, profile: Profile, *, name: str, seed: int = 0) -> None:
        self.name = name
        self.engine: Engine = new_engine(profile, seed=seed)
        self._loop = loop
        self._busy = False
        self._kick_pending = False
        self._due: Timer | None = None  # wakes an idle pod when a KV transfer ends

    def submit(self, request: SimRequest) -> RequestState:
        """The request reaches the pod now; it is scheduled at the next step boundary.

        An idle pod starts its step after every event of the current instant has
        run, so requests arriving together are admitted together (as vLLM's loop
        drains every request that arrived while it was waking up).
        """
        state = self.engine.add(request, self._loop.now)
        if not self._busy and not self._kick_pending:
            self._kick_pending = True
            self._loop.call_at(self._loop.now, self._deferred_kick)
        return state

    def abort(self, state: RequestState) -> None:
        self.engine.abort(state)

    def snapshot(self) -> EngineSnapshot:
        return self.engine.snapshot()

    def _deferred_kick(self) -> None:
        self._kick_pending = False
        self._kick()

    def _kick(self) -> None:
        if self._busy:
            return
        duration = self.engine.start_step(self._loop.now)
        if duration is None:
            self._wake_when_due()
            return
        self._busy = True
        self._loop.call_later(duration, self._step_done)

    def _wake_when_due(self) -> None:
        """An idle pod with a KV transfer under way steps again when it ends."""
        due = self.engine.next_due()
        if self._due is not None:
            if due is not None and self._due.when == due and not self._due.cancelled:
                return
            self._due.cancel()
            self._due = None
        if due is not None:
            self._due = self._loop.call_at(max(due, self._loop.now), self._due_kick)

    def _due_kick(self) -> None:
        self._due = None
        self._kick()

    def _step_done(self) -> None:
        self.engine.finish_step(self._loop.now)
        self._busy = False
        self._kick()
