"""Following every pod's KV-cache event publisher into the precise index, over ZMQ.

One SUB socket per pod (``tcp://<pod ip>:<port>``, vLLM's ``ZmqEventPublisher``
binds it), followed as the pod set changes (``follow``). Each message is
``[topic, seq, payload]`` (``policyd/sim/kv_events.py`` has the format); the
subscriber checks the sequence numbers:

- the next one: applied;
- a jump forward (messages dropped, e.g. at a high-water mark): the missing
  batches are asked from the pod's replay socket (a DEALER to its ROUTER) and
  applied first; without a replay socket, or when it no longer holds them, the
  pod's entries are cleared and indexing starts again from this batch;
- a step back (the publisher restarted and counts from 0 again), or any
  number but the next after the connection dropped: the pod's entries are
  cleared and what the new publisher sent before is replayed;
- the first message from a pod: what it published before is replayed, so a
  pod followed late is indexed as fully as its replay buffer allows.

ZMQ reconnects a dropped connection by itself; a monitor socket reports
connections and drops, which are logged. Batches are applied on the event loop
in calls of at most 256 blocks, and the subscriber yields to the loop whenever
its work has run for half a millisecond, so a burst (a backlog of queued
messages, a replay of thousands of batches) never holds the loop for long. Nothing a pod sends can
raise into the loop: a malformed message is logged and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from policyd.prefix.events import (
    BlockRemoved,
    BlockStored,
    KvEvent,
    base_model_of,
    decode_batch,
)
from policyd.prefix.index import PreciseIndex

_log = logging.getLogger(__name__)

SLICE_BLOCKS: Final = 256  # blocks applied in one call at most (~0.3 ms)
SLICE_S: Final = 0.0005  # event work between two yields to the event loop, at most about
REPLAY_TIMEOUT_S: Final = 2.0  # per reply message; a silent replay socket counts as none
_END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
_SEQ_BYTES: Final = 8
_HWM: Final = 100_000  # as vLLM's publisher: a burst waits in the socket, not dropped
_RECONNECT_IVL_MS: Final = 100
_RECONNECT_IVL_MAX_MS: Final = 5_000
_MONITORED: Final = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


@dataclass(slots=True)
class FeedStats:
    """What one pod's feed did: batches applied, gaps, replays, clears, reconnections."""

    batches: int = 0
    blocks: int = 0
    malformed: int = 0
    gaps: int = 0
    replayed: int = 0  # batches applied from the replay socket
    restarts: int = 0
    clears: int = 0  # a gap that could not be replayed, or a restart
    connects: int = 0
    disconnects: int = 0


@dataclass(slots=True)
class _Feed:
    pod: str
    endpoint: str
    socket: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    stats: FeedStats = field(default_factory=FeedStats)
    expected: int | None = None  # the next sequence number; None before the first message
    dropped: bool = False  # the connection dropped since the last message
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class KvEventSubscriber:
    """Subscribes to each followed pod's KV events and keeps ``index`` up to date.

    ``replay_endpoint`` maps a pod's event endpoint to its replay endpoint
    (vLLM's ``replay_endpoint``, e.g. the same host on another port), or to None
    when it has none. ``model`` gives a pod's base model for topics that do not
    name one (vLLM's default topic is empty; llm-d's convention
    ``kv@<pod>@<model>`` names it): the serving path passes the model each pod's
    metrics name (``pod.base_model``).
    """

    def __init__(
        self,
        index: PreciseIndex,
        *,
        replay_endpoint: Callable[[str], str | None] | None = None,
        model: Callable[[str], str | None] | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.index = index
        self._replay_endpoint = replay_endpoint
        self._model = model
        self._context = context or zmq.asyncio.Context.instance()
        self._feeds: dict[str, _Feed] = {}
        # When the event work running now began: a message already queued completes its
        # receive without suspending, so a backlog or a replay would otherwise run unbroken.
        self._slice_began = time.perf_counter()

    def stats(self, pod: str) -> FeedStats | None:
        """The followed ``pod``'s feed counters, or None when it is not followed."""
        feed = self._feeds.get(pod)
        return None if feed is None else feed.stats

    @property
    def pods(self) -> Mapping[str, str]:
        """Followed pods: name -> event endpoint."""
        return {pod: feed.endpoint for pod, feed in self._feeds.items()}

    def follow(self, pods: Mapping[str, str]) -> None:
        """Follow exactly ``pods`` (name -> ``tcp://ip:port``); pods not there are forgotten."""
        for pod, feed in list(self._feeds.items()):
            if pods.get(pod) != feed.endpoint:
                self._stop(feed)
                self.index.forget(pod)
        for pod, endpoint in pods.items():
            if pod not in self._feeds:
                self._feeds[pod] = self._start(pod, endpoint)

    async def close(self) -> None:
        """Stop following every pod (their index entries stay)."""
        feeds = list(self._feeds.values())
        for feed in feeds:
            self._stop(feed)
        tasks = [task for feed in feeds for task in feed.tasks]
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self, pod: str, endpoint: str) -> _Feed:
        socket = self._context.socket(zmq.SUB)
        socket.set_hwm(_HWM)
        socket.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_IVL_MAX_MS)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = socket.get_monitor_socket(_MONITORED)
        socket.connect(endpoint)
        feed = _Feed(pod, endpoint, socket, monitor)
        feed.tasks = [
            asyncio.create_task(self._receive(feed), name=f"kv-events {pod}"),
            asyncio.create_task(_watch_connection(feed), name=f"kv-events monitor {pod}"),
        ]
        _log.info("following the KV events of %s at %s", pod, endpoint)
        return feed

    def _stop(self, feed: _Feed) -> None:
        del self._feeds[feed.pod]
        for task in feed.tasks:
            task.cancel()
        with contextlib.suppress(zmq.ZMQError):
            feed.socket.disable_monitor()
        feed.monitor.close(linger=0)
        feed.socket.close(linger=0)
        _log.info("stopped following the KV events of %s", feed.pod)

    async def _receive(self, feed: _Feed) -> None:
        while True:
            receiving = asyncio.ensure_future(feed.socket.recv_multipart())
            if receiving.done():
                frames = receiving.result()
            else:
                frames = await receiving
                self._slice_began = time.perf_counter()
            try:
                await self._on_message(feed, frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # a pod's bad data must not end its feed
                _log.exception("KV events of %s: a message could not be applied", feed.pod)

    async def _on_message(self, feed: _Feed, frames: Sequence[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES:
            feed.stats.malformed += 1
            _log.warning("KV events of %s: a message of %d frames skipped", feed.pod, len(frames))
            return
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        model = base_model_of(topic) or (self._model(feed.pod) if self._model else None)
        expected, dropped = feed.expected, feed.dropped
        feed.dropped = False
        if expected is None or seq < expected or (dropped and seq != expected):
            if expected is not None:
                feed.stats.restarts += 1
                self._clear(
                    feed,
                    f"seq {seq} after {expected - 1}"
                    f"{' and a dropped connection' if dropped else ''}: a new publisher",
                )
            if seq > 0:
                await self._catch_up(feed, 0, seq, model)
        elif seq > expected:
            feed.stats.gaps += 1
            if await self._catch_up(feed, expected, seq, model):
                _log.info(
                    "KV events of %s: missed batches %d..%d replayed", feed.pod, expected, seq - 1
                )
            else:
                self._clear(feed, f"batches {expected}..{seq - 1} missed and not replayed")
        feed.expected = seq + 1
        await self._apply(feed, payload, model)

    async def _catch_up(self, feed: _Feed, start: int, end: int, model: str | None) -> bool:
        """Apply batches ``start..end-1`` from the pod's replay socket; whether all were there."""
        batches = await self._replay(feed, start)
        if batches is None:
            return False
        wanted = [(seq, payload) for seq, payload in batches if start <= seq < end]
        if [seq for seq, _ in wanted] != list(range(start, end)):
            _log.warning(
                "KV events of %s: replay gave %d of batches %d..%d",
                feed.pod,
                len(wanted),
                start,
                end - 1,
            )
            return False
        for _, payload in wanted:
            await self._apply(feed, payload, model)
        feed.stats.replayed += len(wanted)
        return True

    async def _replay(self, feed: _Feed, start: int) -> list[tuple[int, bytes]] | None:
        """The batches the pod's replay socket holds from ``start`` on; None without one."""
        endpoint = self._replay_endpoint(feed.endpoint) if self._replay_endpoint else None
        if endpoint is None:
            return None
        dealer = self._context.socket(zmq.DEALER)
        dealer.set(zmq.RCVHWM, 0)  # a replay arrives faster than it is read: keep all of it
        batches: list[tuple[int, bytes]] = []
        loop = asyncio.get_running_loop()
        try:
            dealer.connect(endpoint)
            await dealer.send_multipart((b"", start.to_bytes(_SEQ_BYTES, "big")))
            async with asyncio.timeout(REPLAY_TIMEOUT_S) as deadline:
                while True:
                    frames = await dealer.recv_multipart()
                    deadline.reschedule(loop.time() + REPLAY_TIMEOUT_S)
                    if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES:
                        _log.warning("KV replay of %s: a malformed reply", feed.pod)
                        return batches
                    if frames[1] == _END_SEQ:
                        return batches
                    batches.append((int.from_bytes(frames[1], "big"), frames[2]))
                    await self._yield_when_due()
        except TimeoutError:
            _log.warning("KV replay of %s at %s did not answer", feed.pod, endpoint)
            return batches
        except zmq.ZMQError as error:
            _log.warning("KV replay of %s at %s failed: %s", feed.pod, endpoint, error)
            return batches
        finally:
            dealer.close(linger=0)

    async def _apply(self, feed: _Feed, payload: bytes, model: str | None) -> None:
        batch = decode_batch(payload, model)
        if batch is None:
            feed.stats.malformed += 1
            return
        feed.stats.batches += 1
        chunk: list[KvEvent] = []
        blocks = 0
        for event in batch.events:
            chunk.append(event)
            if isinstance(event, BlockStored | BlockRemoved):
                blocks += len(event.block_hashes)
            if blocks >= SLICE_BLOCKS:
                self.index.apply(feed.pod, chunk)
                feed.stats.blocks += blocks
                chunk, blocks = [], 0
                await self._yield_when_due()
        self.index.apply(feed.pod, chunk)
        feed.stats.blocks += blocks
        await self._yield_when_due()

    async def _yield_when_due(self) -> None:
        """Let the loop run other work once this slice of event work has run its time."""
        if time.perf_counter() - self._slice_began >= SLICE_S:
            await asyncio.sleep(0)
            self._slice_began = time.perf_counter()

    def _clear(self, feed: _Feed, reason: str) -> None:
        feed.stats.clears += 1
        self.index.clear(feed.pod)
        _log.warning("KV events of %s: %s; its index entries cleared", feed.pod, reason)


async def _watch_connection(feed: _Feed) -> None:
    """Log the pod's connections and drops, and mark a drop for the next message's check."""
    while True:
        frames = await feed.monitor.recv_multipart()
        try:
            event = parse_monitor_message(frames)["event"]
        except (ValueError, KeyError, TypeError):
            continue
        if event == zmq.EVENT_CONNECTED:
            feed.stats.connects += 1
            _log.info("KV events of %s: connected to %s", feed.pod, feed.endpoint)
        elif event == zmq.EVENT_DISCONNECTED:
            feed.stats.disconnects += 1
            feed.dropped = True
            _log.warning("KV events of %s: connection to %s dropped", feed.pod, feed.endpoint)
