"""Real time: an engine driven by the asyncio clock, optionally sped up.

Simulated time runs ``time_scale`` times faster than the event loop's clock: a
decode step of 0.09 simulated seconds sleeps 9 ms at ``time_scale=10``. Steps
follow each other on the planned timeline, and an idle engine starts its step
at the arrival that woke it, so a late wake-up of the event loop does not
stretch the schedule; a step never starts before an arrival it may admit.
Every duration the engine reports is therefore in simulated seconds, the same
at any time scale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from policyd.sim.engine import Engine, RequestState, SimRequest

if TYPE_CHECKING:
    from policyd.sim.kv_events import KvEventPublisher

_log = logging.getLogger(__name__)


class RealTimeDriver:
    """Runs one engine's steps on the running event loop."""

    def __init__(
        self,
        engine: Engine,
        time_scale: float = 1.0,
        *,
        kv_events: KvEventPublisher | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("the time scale must be positive")
        self.engine = engine
        self.kv_events = kv_events
        self.time_scale = time_scale
        self._loop = asyncio.get_running_loop()
        self._origin = self._loop.time()
        self._origin_unix = time.time()
        self._wake = asyncio.Event()
        self._latest_arrival = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stats_task: asyncio.Task[None] | None = None

    def now(self) -> float:
        """Simulated seconds since the driver was made."""
        return (self._loop.time() - self._origin) * self.time_scale

    def unix_time(self, simulated: float) -> float:
        """The wall-clock Unix time at which simulated time ``simulated`` happened."""
        return self._origin_unix + simulated / self.time_scale

    def submit(self, request: SimRequest) -> RequestState:
        """Hand a request to the engine now; ``ValueError`` if it can never run."""
        arrival = self.now()
        state = self.engine.add(request, arrival)
        self._latest_arrival = max(self._latest_arrival, arrival)
        self._wake.set()
        return state

    def abort(self, state: RequestState) -> None:
        self.engine.abort(state)

    @property
    def kv_events(self) -> KvEventPublisher | None:
        """Where the engine's KV events go after every step; ``None``: not recorded at all."""
        return self._kv_events

    @kv_events.setter
    def kv_events(self, publisher: KvEventPublisher | None) -> None:
        self._kv_events = publisher
        if publisher is not None:
            self.engine.record_kv_events()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sim-engine")
            self._task.add_done_callback(_report_crash)
            self._stats_task = asyncio.create_task(self._log_stats(), name="sim-stats")
            self._stats_task.add_done_callback(_report_crash)

    async def stop(self) -> None:
        tasks = (self._task, self._stats_task)
        self._task = self._stats_task = None
        for task in tasks:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _run(self) -> None:
        engine = self.engine
        planned_end = 0.0
        while True:
            if not engine.has_work:
                self._wake.clear()
                await self._wake.wait()
            start = max(planned_end, self._latest_arrival)
            duration = engine.start_step(start)
            if duration is None:
                reached = await self._idle(engine.next_due())
                if reached is not None:  # a step may start at that time, not later
                    planned_end = max(planned_end, reached)
                continue
            planned_end = start + duration
            delay = self._origin + planned_end / self.time_scale - self._loop.time()
            await asyncio.sleep(max(delay, 0.0))
            engine.finish_step(planned_end)
            if self._kv_events is not None:  # one batch per step, as vLLM publishes
                self.publish_kv_events(planned_end)

    async def _idle(self, due: float | None) -> float | None:
        """Wait for an arrival, or until ``due`` (a KV transfer ending, held blocks
        going); ``due`` if the wait reached it, ``None`` if an arrival ended it."""
        self._wake.clear()
        if due is None:
            await self._wake.wait()
            return None
        delay = self._origin + due / self.time_scale - self._loop.time()
        try:
            await asyncio.wait_for(self._wake.wait(), max(delay, 0.0))
        except TimeoutError:
            return due
        return None

    def publish_kv_events(self, simulated: float) -> None:
        """Publish the engine's KV events so far as one batch stamped ``simulated``."""
        if self._kv_events is not None:
            self._kv_events.publish(self.engine.take_kv_events(), self.unix_time(simulated))

    async def _log_stats(self) -> None:
        """vLLM's periodic stats logging: every ``log_stats_interval_s`` simulated
        seconds from the start, on the planned timeline (``Engine.log_stats``)."""
        interval = self.engine.profile.log_stats_interval_s
        due = interval
        while True:
            delay = self._origin + due / self.time_scale - self._loop.time()
            await asyncio.sleep(max(delay, 0.0))
            now = self.now()
            self.engine.log_stats(now)
            due += interval
            if due <= now:  # a loop that fell behind does not catch up in a burst
                due = now + interval


def _report_crash(task: asyncio.Task[None]) -> None:
    """An engine that dies would leave its clients hanging: say so loudly."""
    if not task.cancelled() and task.exception() is not None:
        _log.error("simulated engine stopped", exc_info=task.exception())
