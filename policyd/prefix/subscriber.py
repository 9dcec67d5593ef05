"""Following every pod's KV-cache event publisher into the precise index, over ZMQ.

One SUB socket per pod (``tcp://<pod ip>:<port>``, vLLM's ``ZmqEventPublisher``
binds it), followed as the pod set changes (``follow``). Each message is
``[topic, seq, payload]`` (``policyd/sim/kv_events.py`` has the format); the
subscriber checks the sequence numbers:

- the next one: applied;
- a jump forward (messages dropped, e.g. at a high-water mark): the missing
  batches are asked from the pod's replay socket (a DEALER to its ROUTER; its
  replies framed as vLLM's or as llm-d's, which add the topic) and applied
  first; without a replay socket, or when it no longer holds them, the
  pod's entries are cleared and indexing starts again from this batch;
- a step back (the publisher restarted and counts from 0 again), any number
  but the next after the connection dropped, or a jump longer than a replay
  holds (``REPLAY_BATCHES``, so never asked for batch by batch): the
  pod's entries are cleared and the last ``REPLAY_BATCHES`` batches before this
  one are replayed as far as the pod still holds them;
- the first message from a pod: the same replay, so a pod followed late is
  indexed as fully as its replay buffer allows.

Whatever a pod sends, what the subscriber holds for it is bounded: messages of
at most ``MAX_MESSAGE_BYTES``, ``QUEUE_MESSAGES`` of them queued per socket, a
replay applied as it arrives (never collected), asked for at most
``REPLAY_BATCHES`` batches and given ``REPLAY_DEADLINE_S`` in all; a replay
socket that does not answer is left alone for ``REPLAY_BACKOFF_S``. The index
caps each pod's blocks (``PreciseIndex.max_blocks_per_pod``).

A monitor socket reports connections and drops, which are logged; after a
drop the subscriber connects anew (libzmq reconnects after a connection
error by itself, but not after a protocol error such as an oversized
message), waiting longer the more drops come before a message. Batches are applied on the event loop
in calls of at most 256 blocks, and the subscriber yields to the loop whenever
its work has run for half a millisecond, so a burst (a backlog of queued
messages, a replay of thousands of batches) never holds the loop for long.
Nothing a pod sends can raise into the loop: a malformed message is skipped,
counted and logged without its contents, once a minute per pod at most.
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
# ZMQ_MAXMSGSIZE of both sockets: libzmq drops a longer message and the connection with it
# (ZMQ reconnects). A batch of one engine step is ~5 bytes per token id, tens of KB at
# vLLM's default max_num_batched_tokens; decoding one costs at most ~40 bytes per byte.
MAX_MESSAGE_BYTES: Final = 1 << 20
# Messages each socket queues (RCVHWM): a longer backlog waits at the publisher (its
# own high-water mark, 100,000 in vLLM), so a pod makes policyd hold at most this many
# messages of MAX_MESSAGE_BYTES per socket.
QUEUE_MESSAGES: Final = 100
# The most batches a replay asks for: vLLM's default replay buffer (buffer_steps). A gap
# longer than this is not bridged (the pod no longer holds it): the pod is cleared.
REPLAY_BATCHES: Final = 10_000
REPLAY_IDLE_S: Final = 2.0  # without a first reply for this long, the replay socket is silent
# A ROUTER sends a whole answer at once and drops what exceeds its high-water mark, the
# end marker with it: a pause this long after replies began means the rest is lost.
REPLAY_PAUSE_S: Final = 0.25
REPLAY_DEADLINE_S: Final = 30.0  # one replay in all, however its replies trickle in
# A replay socket that did not answer is not asked again for this long: each
# gap meanwhile clears the pod at once instead of waiting REPLAY_IDLE_S.
REPLAY_BACKOFF_S: Final = 30.0
MALFORMED_LOG_INTERVAL_S: Final = 60.0  # one warning per pod at most this often
_END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
_SEQ_BYTES: Final = 8
# A replay reply after the DEALER's empty delimiter: vLLM's [seq, payload]; llm-d's
# (its router reads it, its inference-sim writes it) [topic, seq, payload].
_LLM_D_REPLY_FRAMES: Final = 4
_RECONNECT_IVL_MS: Final = 100
_RECONNECT_IVL_MAX_MS: Final = 5_000
_MONITORED: Final = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


@dataclass(slots=True)
class FeedStats:
    """What one pod's feed did: plain counters (each only grows) and the last lag.

    ``batches`` and ``blocks`` applied (live and replayed); ``malformed``
    messages skipped whole (wrong frames, a payload that is no batch) and
    ``malformed_events`` skipped within a batch; ``gaps`` (a jump forward),
    ``restarts`` (a step back, or a jump after a dropped connection) and
    ``clears`` (the pod's entries dropped: a gap not bridged, a restart);
    ``replay_requests`` sent to the replay socket, ``replayed`` batches applied
    from it and ``replay_silent`` requests it did not answer (then it is not
    asked for ``REPLAY_BACKOFF_S``); ``connects`` and ``disconnects`` of the
    event socket (a message over ``MAX_MESSAGE_BYTES`` shows as a disconnect,
    since libzmq drops the connection with it). ``lag_seconds``: how long
    after its timestamp (the pod's clock) the last live batch was applied,
    None before the first; replayed batches are old by nature and leave it.
    """

    batches: int = 0
    blocks: int = 0
    malformed: int = 0
    malformed_events: int = 0
    gaps: int = 0
    restarts: int = 0
    clears: int = 0
    replay_requests: int = 0
    replayed: int = 0
    replay_silent: int = 0
    connects: int = 0
    disconnects: int = 0
    lag_seconds: float | None = None


@dataclass(slots=True)
class _Feed:
    pod: str
    endpoint: str
    socket: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    stats: FeedStats = field(default_factory=FeedStats)
    expected: int | None = None  # the next sequence number; None before the first message
    dropped: bool = False  # the connection dropped since the last message
    drops_in_a_row: int = 0  # connection drops since the last message
    replay_paused_until: float = 0.0  # loop time before which the replay socket is not asked
    malformed_logged_at: float | None = None  # loop time of the last malformed warning
    malformed_unlogged: int = 0  # malformed messages and events since that warning
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
        socket.set(zmq.RCVHWM, QUEUE_MESSAGES)
        socket.set(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
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
            self._malformed(feed, f"a message of {len(frames)} frames")
            return
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        model = base_model_of(topic) or (self._model(feed.pod) if self._model else None)
        expected, dropped = feed.expected, feed.dropped
        feed.dropped, feed.drops_in_a_row = False, 0
        feed.expected = seq + 1
        if expected is not None and seq == expected:
            pass
        elif expected is not None and seq > expected and not dropped:
            feed.stats.gaps += 1
            missed = f"batches {expected}..{seq - 1} missed"
            if seq - expected > REPLAY_BATCHES:
                self._clear(feed, f"{missed}, more than a replay holds")
                await self._catch_up(feed, seq - REPLAY_BATCHES, seq, model, cleared=True)
            elif await self._catch_up(feed, expected, seq, model, cleared=False):
                _log.info("KV events of %s: %s and replayed", feed.pod, missed)
            else:
                self._clear(feed, f"{missed} and not replayed")
        else:
            if expected is not None:
                feed.stats.restarts += 1
                self._clear(
                    feed,
                    f"seq {seq} after {expected - 1}"
                    f"{' and a dropped connection' if dropped else ''}: a new publisher",
                )
            await self._catch_up(feed, max(0, seq - REPLAY_BATCHES), seq, model, cleared=True)
        await self._apply(feed, payload, model, live=True)

    async def _catch_up(
        self, feed: _Feed, start: int, end: int, model: str | None, *, cleared: bool
    ) -> bool:
        """Apply batches ``start..end-1`` from the pod's replay socket; whether all came.

        ``cleared``: the pod's entries are empty, so any run of batches ending at
        ``end - 1`` is sound to apply (blocks chained to earlier ones are not
        indexed), and the run may start later than ``start``. The replay is
        read as it arrives, a batch at a time; when a run breaks (a ROUTER
        drops what exceeds its high-water mark, 1,000 by default in vLLM), the
        rest is asked for again from the first batch missing.
        """
        endpoint = self._replay_endpoint(feed.endpoint) if self._replay_endpoint else None
        if start >= end:
            return True
        loop = asyncio.get_running_loop()
        if endpoint is None or loop.time() < feed.replay_paused_until:
            return False
        deadline = loop.time() + REPLAY_DEADLINE_S
        wanted = start
        while wanted < end and loop.time() < deadline:
            reached = await self._ask_replay(
                feed,
                endpoint,
                wanted,
                end,
                model,
                deadline=deadline,
                anywhere=cleared and wanted == start,
            )
            if reached is None:
                feed.stats.replay_silent += 1
                feed.replay_paused_until = loop.time() + REPLAY_BACKOFF_S
                _log.warning(
                    "KV replay of %s at %s did not answer; not asked for %.0f s",
                    feed.pod,
                    endpoint,
                    REPLAY_BACKOFF_S,
                )
                return False
            if reached == wanted:  # nothing new: the pod no longer holds the batch
                break
            wanted = reached
        if wanted < end and (wanted > start or not cleared):
            _log.warning(
                "KV events of %s: the replay of batches %d..%d stopped before %d",
                feed.pod,
                start,
                end - 1,
                wanted,
            )
        return wanted >= end

    async def _ask_replay(
        self,
        feed: _Feed,
        endpoint: str,
        start: int,
        end: int,
        model: str | None,
        *,
        deadline: float,
        anywhere: bool,
    ) -> int | None:
        """Ask for the batches from ``start`` on and apply the consecutive run of them.

        The run must begin at ``start`` (with ``anywhere``, at any batch before
        ``end``) and is read up to ``end - 1`` at most. Returns the number of the
        first batch still missing; None when the socket did not answer at all.
        """
        dealer = self._context.socket(zmq.DEALER)
        dealer.set(zmq.RCVHWM, QUEUE_MESSAGES)
        dealer.set(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        loop = asyncio.get_running_loop()
        feed.stats.replay_requests += 1
        wanted, answered = start, False
        try:
            dealer.connect(endpoint)
            async with asyncio.timeout_at(min(deadline, loop.time() + REPLAY_IDLE_S)):
                await dealer.send_multipart((b"", start.to_bytes(_SEQ_BYTES, "big")))
            while wanted < end:
                idle = REPLAY_PAUSE_S if answered else REPLAY_IDLE_S
                async with asyncio.timeout_at(min(deadline, loop.time() + idle)):
                    frames = await dealer.recv_multipart()
                answered = True
                if len(frames) == _LLM_D_REPLY_FRAMES:
                    del frames[1]  # the topic: llm-d's replies carry it, vLLM's do not
                if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES or frames[1] == _END_SEQ:
                    break
                seq = int.from_bytes(frames[1], "big")
                if seq != wanted and not (anywhere and wanted == start and start < seq < end):
                    break
                wanted = seq + 1
                feed.stats.replayed += 1
                await self._apply(feed, frames[2], model)
        except TimeoutError:
            pass
        except zmq.ZMQError as error:
            _log.warning("KV replay of %s at %s failed: %s", feed.pod, endpoint, error)
        finally:
            dealer.close(linger=0)
        return wanted if answered else None

    async def _apply(
        self, feed: _Feed, payload: bytes, model: str | None, *, live: bool = False
    ) -> None:
        batch = decode_batch(payload, model)
        if batch is None:
            feed.stats.malformed += 1
            self._malformed(feed, f"a payload of {len(payload)} bytes that is no event batch")
            return
        if live:
            feed.stats.lag_seconds = max(0.0, time.time() - batch.ts)
        if batch.skipped:
            feed.stats.malformed_events += batch.skipped
            self._malformed(feed, f"{batch.skipped} events of an unknown tag or wrong fields")
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

    def _malformed(self, feed: _Feed, what: str) -> None:
        """Log what a pod sent wrong, never its contents, once a minute per pod at most."""
        now = asyncio.get_running_loop().time()
        logged_at = feed.malformed_logged_at
        if logged_at is not None and now - logged_at < MALFORMED_LOG_INTERVAL_S:
            feed.malformed_unlogged += 1
            return
        _log.warning(
            "KV events of %s: %s skipped (%d more malformed in the last %.0f s, not logged)",
            feed.pod,
            what,
            feed.malformed_unlogged,
            MALFORMED_LOG_INTERVAL_S,
        )
        feed.malformed_logged_at, feed.malformed_unlogged = now, 0

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
            feed.drops_in_a_row += 1
            delay_ms = min(_RECONNECT_IVL_MAX_MS, _RECONNECT_IVL_MS << min(feed.drops_in_a_row, 16))
            _log.warning(
                "KV events of %s: connection to %s dropped; reconnecting in %d ms",
                feed.pod,
                feed.endpoint,
                delay_ms,
            )
            # libzmq reconnects after a connection error, but a protocol error (a
            # message over MAXMSGSIZE) ends the connection for good: connect anew.
            # The delay grows with each drop before a message, so a pod that keeps
            # sending what drops the connection is not reconnected in a tight loop.
            await asyncio.sleep(delay_ms / 1000)
            with contextlib.suppress(zmq.ZMQError):  # already gone after a protocol error
                feed.socket.disconnect(feed.endpoint)
            feed.socket.connect(feed.endpoint)
