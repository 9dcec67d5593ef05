"""KV-cache events of one pod, published the way vLLM publishes them.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", ...}'`` publishes, after every engine step that changed its
prefix cache, one ``KVEventBatch`` on a ZMQ PUB socket and keeps the recent
batches for a ROUTER replay socket (``vllm/distributed/kv_events.py``,
``ZmqEventPublisher``). The simulator does the same:

- PUB message, three frames: ``[topic, seq, payload]``; ``seq`` an unsigned
  8-byte big-endian counter from 0 per publisher (a restarted pod starts again
  at 0); ``topic`` here ``kv@<host:port>@<base model>``, the convention llm-d
  configures vLLM with.
- ``payload`` is msgpack of msgspec's array-like encoding of ``KVEventBatch``:
  ``[ts, [event, ...], data_parallel_rank]`` with ``ts`` Unix seconds (float)
  and the rank 0; each event an array whose first element is its tag:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``. Hashes are unsigned 64-bit integers (vLLM's default
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), ``medium`` is ``"GPU"``,
  ``lora_id`` the adapter's 1-based index on the pod and ``lora_name`` its name
  (both ``None`` for the base model; ``lora_name`` is the eighth field since
  vLLM PR #27577, which deprecates ``lora_id`` for it).
- Replay: a client sends ``[b"", seq]`` (8 bytes big-endian) from a DEALER (or
  REQ) socket; the ROUTER answers every buffered batch from ``seq`` on as
  ``[b"", seq, payload]``, then ``[b"", -1 (8 bytes, signed), b""]``.

The PUB socket is libzmq's XPUB, which sends exactly what a PUB sends but also
hands up each subscription it receives: ``subscriptions()`` counts them, so a
test can wait until a subscriber's subscription reached the pod (ZMQ's "slow
joiner": a batch published before that is not sent to it) instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgpack
import zmq
import zmq.asyncio

from policyd.sim.blocks import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent

MEDIUM_GPU: Final = "GPU"
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
REPLAY_BUFFER_STEPS: Final = 10_000  # vLLM's default buffer_steps
_HWM: Final = 100_000  # vLLM's default high-water mark
_REBIND_WAIT_S: Final = 2.0
_REPLAY_SLICE: Final = 64  # batches a replay sends between two yields to the pod's event loop

_log = logging.getLogger(__name__)


def encode_event(event: KvEvent, block_size: int, lora_ids: Mapping[str, int]) -> list[Any]:
    """One event as msgspec encodes vLLM's array-like, tagged ``KVCacheEvent`` structs."""
    if isinstance(event, BlocksStored):
        lora_id = None if event.adapter is None else lora_ids.get(event.adapter)
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            block_size,
            lora_id,
            MEDIUM_GPU,
            event.adapter,
        ]
    if isinstance(event, BlocksRemoved):
        return ["BlockRemoved", list(event.block_hashes), MEDIUM_GPU]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(
    events: Sequence[KvEvent], ts: float, block_size: int, lora_ids: Mapping[str, int]
) -> bytes:
    """A ``KVEventBatch`` payload: ``[ts, events, data_parallel_rank]`` in msgpack."""
    encoded = [encode_event(event, block_size, lora_ids) for event in events]
    payload: bytes = msgpack.packb([ts, encoded, 0])
    return payload


class KvEventPublisher:
    """The PUB socket, the replay buffer and the ROUTER replay socket of one pod."""

    @classmethod
    async def open(
        cls,
        *,
        host: str,
        port: int,
        replay_port: int | None,
        topic: str,
        block_size: int,
        lora_ids: Mapping[str, int],
        buffer_steps: int = REPLAY_BUFFER_STEPS,
    ) -> KvEventPublisher:
        """Bind the sockets (0: a free port) and start answering replay requests."""
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        pub = context.socket(zmq.XPUB)
        pub.set_hwm(_HWM)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only a topic's first
        router: zmq.Socket[bytes] | None = None
        try:
            port = await _bind(pub, host, port)
            if replay_port is not None:
                router = context.socket(zmq.ROUTER)
                # A ROUTER drops what exceeds its high-water mark: room for a whole replay.
                router.set_hwm(buffer_steps + 1)
                replay_port = await _bind(router, host, replay_port)
        except BaseException:
            pub.close(linger=0)
            if router is not None:
                router.close(linger=0)
            raise
        return cls(
            pub,
            router,
            host=host,
            port=port,
            replay_port=replay_port,
            topic=topic,
            block_size=block_size,
            lora_ids=lora_ids,
            buffer_steps=buffer_steps,
        )

    def __init__(
        self,
        pub: zmq.Socket[bytes],
        router: zmq.Socket[bytes] | None,
        *,
        host: str,
        port: int,
        replay_port: int | None,
        topic: str,
        block_size: int,
        lora_ids: Mapping[str, int],
        buffer_steps: int,
    ) -> None:
        self.topic = topic
        self._topic = topic.encode()
        self._block_size = block_size
        self._lora_ids = dict(lora_ids)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._pub = pub
        self._subscriptions = 0
        self.port = port
        self.replay_port = replay_port
        self.endpoint = f"tcp://{host}:{port}"
        self.replay_endpoint = None if replay_port is None else f"tcp://{host}:{replay_port}"
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if router is not None:
            self._replay = zmq.asyncio.Socket.from_socket(router)
            self._replay_task = asyncio.create_task(self._serve_replay(), name="sim-kv-replay")

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._seq

    def subscriptions(self) -> int:
        """How many subscriptions have reached the socket so far (reconnections count again)."""
        while True:
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return self._subscriptions
            if message[:1] == b"\x01":  # b"\x00" + topic: an unsubscription
                self._subscriptions += 1

    def publish(self, events: Sequence[KvEvent], ts: float) -> None:
        """Send one batch (nothing if ``events`` is empty) and keep it for replay."""
        if not events:
            return
        self.subscriptions()  # read what the socket queued, so that it does not pile up
        payload = encode_batch(events, ts, self._block_size, self._lora_ids)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):  # a PUB socket drops at its high-water mark
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    async def close(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._replay is not None:
            self._replay.close(linger=0)
        self._pub.close(linger=0)

    async def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                _log.warning("malformed KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for sent, (seq, payload) in enumerate(
                [(seq, payload) for seq, payload in self._buffer if seq >= start_seq], 1
            ):
                await replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                if sent % _REPLAY_SLICE == 0:  # a send that does not block does not yield
                    await asyncio.sleep(0)
            await replay.send_multipart((client, b"", END_SEQ, b""))


async def _bind(socket: zmq.Socket[bytes], host: str, port: int) -> int:
    if port == 0:
        return socket.bind_to_random_port(f"tcp://{host}")
    # A pod that comes back rebinds the ports its previous sockets held; ZMQ's I/O
    # thread releases a closed socket's port a moment after close() returns.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _REBIND_WAIT_S
    while True:
        try:
            socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as error:
            if error.errno != zmq.EADDRINUSE or loop.time() > deadline:
                raise
            await asyncio.sleep(0.01)
        else:
            return port
