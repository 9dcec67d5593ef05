"""The KV-event subscriber against the simulator's real publisher, over real ZMQ and msgpack."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from policyd.prefix.index import PreciseIndex
from policyd.prefix.keys import block_keys
from policyd.prefix.subscriber import KvEventSubscriber
from policyd.sim.blocks import BlocksRemoved, BlocksStored
from policyd.sim.kv_events import KvEventPublisher, encode_batch
from policyd.sim.profile import L4_LLAMA2_7B
from policyd.sim.server import SimServer
from policyd.sim.tokenizer import block_hashes, tokenize

BASE = L4_LLAMA2_7B.base_model
# A liveness bound, not a speed one: generous, so a loaded 2-core machine cannot trip it.
WAIT_S = 30.0


def words(prefix: str, count: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(count))


async def eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        await asyncio.sleep(0.01)


def batches(subscriber: KvEventSubscriber, pod: str) -> int:
    stats = subscriber.stats(pod)
    return 0 if stats is None else stats.batches


async def receiving(
    probe: Callable[[], Awaitable[None]], *listening: Callable[[], bool], what: str
) -> None:
    """Probe until every listener has received something: its subscription is in place.

    A SUB socket's subscription reaches a PUB a moment after it connects, and the
    PUB drops what it sends before (ZMQ's "slow joiner"): the probes are events
    that change no index (an empty cache reset, no blocks removed, a prompt no
    assertion reads).
    """
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not all(received() for received in listening):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what} received")
        await probe()
        await asyncio.sleep(0.05)


async def subscribed(xpub: zmq.asyncio.Socket) -> None:
    """A subscription reached the XPUB (which reports them, unlike a PUB)."""
    async with asyncio.timeout(WAIT_S):
        while (await xpub.recv())[:1] != b"\x01":
            pass


def matched(index: PreciseIndex, pod: str, text: str, model: str = BASE) -> int:
    return index.match(block_keys(tokenize(text), 16, model), [pod])[0]


@contextlib.asynccontextmanager
async def running(server: SimServer) -> AsyncIterator[SimServer]:
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def following(
    index: PreciseIndex, pods: dict[str, str], replay: dict[str, str | None] | None = None
) -> AsyncIterator[KvEventSubscriber]:
    subscriber = KvEventSubscriber(index, replay_endpoint=None if replay is None else replay.get)
    subscriber.follow(pods)
    try:
        yield subscriber
    finally:
        await subscriber.close()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def complete(
    client: aiohttp.ClientSession, server: SimServer, prompt: str, model: str = BASE
) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    async with client.post(server.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


def reset_probe(client: aiohttp.ClientSession, server: SimServer) -> Callable[[], Awaitable[None]]:
    """A probe for an empty pod: resetting its cache publishes AllBlocksCleared."""

    async def probe() -> None:
        async with client.post(server.url + "/reset_prefix_cache") as response:
            assert response.status == 200

    return probe


def pod_server(blocks: int = 700, *, replay: bool = True) -> SimServer:
    return SimServer(
        L4_LLAMA2_7B.with_changes(num_gpu_blocks=blocks),
        port=0,
        time_scale=200.0,
        adapters=("adapter-0", "adapter-1"),
        kv_events_port=0,
        kv_replay_port=0 if replay else None,
    )


class Observer:
    """A plain SUB socket on the same publisher: the engine hashes the pod holds, by its events."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.held: set[int] = set()
        self.received = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            _, _, payload = await self.socket.recv_multipart()
            self.received += 1
            for event in msgpack.unpackb(payload)[1]:
                if event[0] == "BlockStored":
                    self.held.update(event[1])
                elif event[0] == "BlockRemoved":
                    self.held.difference_update(event[1])
                else:
                    self.held.clear()

    def leading(self, text: str, model: str = BASE) -> int:
        count = 0
        for engine_hash in block_hashes(tokenize(text), 16, model):
            if engine_hash not in self.held:
                break
            count += 1
        return count

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.socket.close(linger=0)


async def test_stored_removed_and_cleared_blocks_arrive_in_the_index(
    client: aiohttp.ClientSession,
) -> None:
    index = PreciseIndex()
    async with running(pod_server(16)) as pod:  # 16 blocks: the prompts below evict
        assert pod.kv_events_endpoint is not None
        observer = Observer(pod.kv_events_endpoint)
        async with following(index, {pod.address: pod.kv_events_endpoint}) as subscriber:
            await receiving(
                reset_probe(client, pod),
                lambda: batches(subscriber, pod.address) > 0,
                lambda: observer.received > 0,
                what="a reset",
            )
            shared = words("sys", 40)
            prompts = [(shared + " " + words("q", 40), BASE), (shared + " other", "adapter-1")]
            prompts += [(words(f"p{n}_", 64), BASE) for n in range(4)]

            def agree() -> bool:
                return index.blocks(pod.address) == len(observer.held) and all(
                    matched(index, pod.address, text, model) == observer.leading(text, model)
                    for text, model in prompts
                )

            for text, model in prompts[:2]:
                await complete(client, pod, text, model)
            # Both requests' blocks are announced: 5 of the first prompt, and 2
            # of the adapter's (its own chain, though the text starts alike).
            await eventually(
                lambda: agree() and observer.leading(prompts[1][0], "adapter-1") == 2, "stored"
            )
            assert matched(index, pod.address, prompts[0][0]) == 5
            assert matched(index, pod.address, prompts[1][0], "adapter-1") == 2
            for text, model in prompts[2:]:
                await complete(client, pod, text, model)
            await eventually(lambda: agree() and observer.leading(prompts[0][0]) < 5, "evicted")
            async with client.post(pod.url + "/reset_prefix_cache") as response:
                assert response.status == 200
            await eventually(lambda: index.blocks(pod.address) == 0, "cleared")
            stats = subscriber.stats(pod.address)
            assert stats is not None and stats.gaps == stats.clears == stats.malformed == 0
        await observer.close()


async def test_a_pod_followed_late_is_replayed_from_its_first_batch(
    client: aiohttp.ClientSession,
) -> None:
    index = PreciseIndex()
    async with running(pod_server()) as pod:
        assert pod.kv_events_endpoint is not None and pod.kv_replay_endpoint is not None
        for n in range(3):  # nobody listens yet
            await complete(client, pod, words(f"early{n}_", 40))
        replay: dict[str, str | None] = {pod.kv_events_endpoint: pod.kv_replay_endpoint}
        async with following(index, {pod.address: pod.kv_events_endpoint}, replay) as sub:
            await receiving(
                lambda: complete(client, pod, words("probe", 40)),
                lambda: batches(sub, pod.address) > 0,
                what="a probe",
            )
            await complete(client, pod, words("late", 40))
            await eventually(lambda: matched(index, pod.address, words("late", 40)) == 2, "late")
            assert [matched(index, pod.address, words(f"early{n}_", 40)) for n in range(3)] == [
                2,
                2,
                2,
            ]
            stats = sub.stats(pod.address)
            # The three early batches, and probes sent before the subscription was in place.
            assert stats is not None and stats.replayed >= 3 and stats.clears == 0


class DroppingPub:
    """The publisher's socket, losing the messages sent while ``dropping`` is set (what
    it hears, the subscriptions, passes)."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket
        self.dropping = False

    def recv(self, flags: int = 0) -> bytes:
        return bytes(self.socket.recv(flags))

    def send_multipart(self, frames: Any, flags: int = 0) -> None:
        if not self.dropping:
            self.socket.send_multipart(frames, flags)

    def close(self, linger: int | None = None) -> None:
        self.socket.close(linger=linger)


def no_op_probe(publisher: KvEventPublisher) -> Callable[[], Awaitable[None]]:
    """A probe for a publisher: a batch removing no blocks."""

    async def probe() -> None:
        publisher.publish([BlocksRemoved(())], 0.0)

    return probe


def stored(text: str) -> BlocksStored:
    tokens = tokenize(text)
    hashes = block_hashes(tokens, 16, BASE)
    return BlocksStored(tuple(hashes), None, tuple(tokens[: 16 * len(hashes)]), None)


@pytest.mark.parametrize("replay", [True, False])
async def test_a_dropped_range_is_replayed_or_else_the_pod_is_cleared(
    replay: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    publisher = await KvEventPublisher.open(
        host="127.0.0.1",
        port=0,
        replay_port=0 if replay else None,
        topic=f"kv@pod-a@{BASE}",
        block_size=16,
        lora_ids={},
    )
    pub = DroppingPub(publisher._pub)
    monkeypatch.setattr(publisher, "_pub", pub)
    index = PreciseIndex()
    replays = {publisher.endpoint: publisher.replay_endpoint}
    try:
        async with following(index, {"pod-a": publisher.endpoint}, replays) as subscriber:
            await receiving(
                no_op_probe(publisher), lambda: batches(subscriber, "pod-a") > 0, what="a probe"
            )
            stats = subscriber.stats("pod-a")
            assert stats is not None
            replayed = stats.replayed  # probes sent before the subscription was in place
            publisher.publish([stored(words("zero", 40))], 1.0)
            await eventually(lambda: matched(index, "pod-a", words("zero", 40)) == 2, "seq 0")
            pub.dropping = True
            publisher.publish([stored(words("one", 40))], 2.0)
            publisher.publish([stored(words("two", 40))], 3.0)
            pub.dropping = False
            publisher.publish([stored(words("three", 40))], 4.0)
            await eventually(lambda: matched(index, "pod-a", words("three", 40)) == 2, "seq 3")
            assert stats.gaps == 1
            held = [matched(index, "pod-a", words(w, 40)) for w in ("zero", "one", "two")]
            if replay:
                assert held == [2, 2, 2] and stats.replayed - replayed == 2 and stats.clears == 0
            else:
                assert held == [0, 0, 0] and stats.replayed == 0 and stats.clears == 1
    finally:
        await publisher.close()


async def test_a_restarted_pod_clears_its_entries(client: aiohttp.ClientSession) -> None:
    index = PreciseIndex()
    async with running(pod_server()) as pod:
        assert pod.kv_events_endpoint is not None and pod.kv_replay_endpoint is not None
        replay: dict[str, str | None] = {pod.kv_events_endpoint: pod.kv_replay_endpoint}
        async with following(index, {pod.address: pod.kv_events_endpoint}, replay) as sub:
            await receiving(
                reset_probe(client, pod), lambda: batches(sub, pod.address) > 0, what="a reset"
            )
            for n in range(3):
                await complete(client, pod, words(f"old{n}_", 40))
            await eventually(lambda: index.blocks(pod.address) == 6, "old blocks")
            await pod.go_away()
            await pod.come_back()  # a fresh engine on the same ports, seq from 0
            received = batches(sub, pod.address)
            await receiving(
                reset_probe(client, pod),
                lambda: batches(sub, pod.address) > received,
                what="a reset",
            )
            await complete(client, pod, words("new", 40))
            await eventually(lambda: matched(index, pod.address, words("new", 40)) == 2, "new")
            assert index.blocks(pod.address) == 2
            stats = sub.stats(pod.address)
            assert stats is not None and stats.restarts == 1 and stats.disconnects >= 1


async def test_pods_come_and_go_and_bad_messages_are_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index = PreciseIndex()
    context = zmq.asyncio.Context.instance()
    sockets = [context.socket(zmq.XPUB) for _ in range(3)]
    for socket in sockets:
        socket.setsockopt(zmq.XPUB_VERBOSE, 1)
    endpoints = [f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in sockets]

    async def send(socket: zmq.asyncio.Socket, seq: int, text: str, topic: bytes) -> None:
        payload = encode_batch([stored(text)], 1.0, 16, {})
        await socket.send_multipart((topic, seq.to_bytes(8, "big"), payload))

    try:
        async with following(index, {"a": endpoints[0], "b": endpoints[1]}) as subscriber:
            await subscribed(sockets[0])
            await subscribed(sockets[1])
            with caplog.at_level(logging.WARNING, "policyd.prefix"):
                await sockets[0].send_multipart((b"kv@a@" + BASE.encode(), b"short"))
                await sockets[0].send_multipart((b"kv", b"\0" * 8, b"\xc1not msgpack"))
                await send(sockets[0], 0, words("a", 40), f"kv@a@{BASE}".encode())
                await send(sockets[1], 0, words("b", 40), f"kv@b@{BASE}".encode())
                await eventually(lambda: index.blocks("a") == index.blocks("b") == 2, "a, b")
            stats = subscriber.stats("a")
            assert stats is not None and stats.malformed == 2 and stats.batches == 1
            assert "a message of 2 frames" in caplog.text
            # b leaves, c comes: b's entries go, c's arrive.
            subscriber.follow({"a": endpoints[0], "c": endpoints[2]})
            assert subscriber.stats("b") is None and index.blocks("b") == 0
            assert dict(subscriber.pods) == {"a": endpoints[0], "c": endpoints[2]}
            await subscribed(sockets[2])
            await send(sockets[2], 0, words("c", 40), f"kv@c@{BASE}".encode())
            await eventually(lambda: matched(index, "c", words("c", 40)) == 2, "c")
            assert matched(index, "a", words("a", 40)) == 2
    finally:
        for socket in sockets:
            socket.close(linger=0)


async def test_a_long_replay_is_applied_without_holding_the_event_loop() -> None:
    publisher = await KvEventPublisher.open(
        host="127.0.0.1",
        port=0,
        replay_port=0,
        topic=f"kv@pod-a@{BASE}",
        block_size=16,
        lora_ids={},
    )
    index = PreciseIndex()
    texts = [words(f"b{n}_", 160) for n in range(5000)]
    for n, text in enumerate(texts):  # nobody listens yet: all of it comes by replay
        publisher.publish([stored(text)], float(n))
    longest = 0.0
    ticking = True

    async def tick() -> None:
        # The loop's own CPU time between two turns of this task: how long other work held
        # the loop, whatever else the machine runs.
        nonlocal longest
        last = time.thread_time()
        while ticking:
            await asyncio.sleep(0)
            now = time.thread_time()
            longest, last = max(longest, now - last), now

    replays: dict[str, str | None] = {publisher.endpoint: publisher.replay_endpoint}
    try:
        async with following(index, {"pod-a": publisher.endpoint}, replays) as subscriber:
            ticker = asyncio.create_task(tick())
            # The first batch received sets off the replay, while the ticker runs.
            await receiving(
                no_op_probe(publisher), lambda: batches(subscriber, "pod-a") > 0, what="a probe"
            )
            publisher.publish([stored(words("last", 40))], 0.0)
            await eventually(lambda: index.blocks("pod-a") == 10 * len(texts) + 2, "replayed")
            ticking = False
            await ticker
            stats = subscriber.stats("pod-a")
            assert stats is not None and stats.replayed >= len(texts)  # and early probes
    finally:
        await publisher.close()
    # Applying 50,000 blocks in one go holds the loop ~0.1 s; in slices, a few milliseconds.
    assert longest < 0.05


async def test_a_replay_longer_than_the_routers_high_water_mark_is_asked_again_where_it_broke() -> (
    None
):
    # vLLM's replay ROUTER keeps the default high-water mark (1,000 messages) and sends
    # its whole buffer at once, dropping what does not fit; the subscriber queues 100
    # messages of a replay, so it reads a run, and asks again from the first one lost.
    context = zmq.asyncio.Context.instance()
    xpub = context.socket(zmq.XPUB)
    xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
    router = context.socket(zmq.ROUTER)
    router.set_hwm(1_000)
    endpoint = f"tcp://127.0.0.1:{xpub.bind_to_random_port('tcp://127.0.0.1')}"
    replay = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    # Each batch stores 2 blocks and names 1,000 blocks the pod never had (~9 KB): more
    # than the TCP buffers between the two sockets hold at once.
    texts = [words(f"r{n}_", 40) for n in range(3000)]
    padding = BlocksRemoved(tuple(range(2**60, 2**60 + 1000)))
    buffered = [
        (n, encode_batch([stored(text), padding], 1.0, 16, {})) for n, text in enumerate(texts)
    ]

    async def serve_replay() -> None:
        while True:
            client, _, start = await router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in buffered[first:]:  # no yield in between, as vLLM's thread
                await router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await router.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))

    serving = asyncio.create_task(serve_replay())
    index = PreciseIndex()
    try:
        async with following(index, {"pod-a": endpoint}, {endpoint: replay}) as subscriber:
            await subscribed(xpub)
            last = encode_batch([stored(words("last", 40))], 1.0, 16, {})
            topic = f"kv@pod-a@{BASE}".encode()
            await xpub.send_multipart((topic, len(texts).to_bytes(8, "big"), last))
            await eventually(lambda: index.blocks("pod-a") == 2 * len(texts) + 2, "replayed")
            stats = subscriber.stats("pod-a")
            assert stats is not None and stats.replayed == len(texts) and stats.clears == 0
            assert stats.replay_requests > 1
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        router.close(linger=0)
        xpub.close(linger=0)


async def test_replay_replies_that_carry_the_topic_are_replayed() -> None:
    # llm-d's framing (its router reads it, its inference-sim writes it): each replay reply
    # is [topic, seq, payload] after the delimiter, the end marker [b"", -1, b""]; vLLM's
    # has no topic frame.
    context = zmq.asyncio.Context.instance()
    xpub = context.socket(zmq.XPUB)
    xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
    router = context.socket(zmq.ROUTER)
    endpoint = f"tcp://127.0.0.1:{xpub.bind_to_random_port('tcp://127.0.0.1')}"
    replay = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    topic = f"kv@127.0.0.1:8000@{BASE}".encode()
    texts = [words(f"t{n}_", 40) for n in range(3)]
    buffered = [(n + 1, encode_batch([stored(text)], 1.0, 16, {})) for n, text in enumerate(texts)]

    async def serve_replay() -> None:
        while True:
            client, _, start = await router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in buffered:
                if seq >= first:
                    await router.send_multipart(
                        (client, b"", topic, seq.to_bytes(8, "big"), payload)
                    )
            await router.send_multipart((client, b"", b"", b"\xff" * 8, b""))

    serving = asyncio.create_task(serve_replay())
    index = PreciseIndex()
    try:
        async with following(index, {"pod-a": endpoint}, {endpoint: replay}) as subscriber:
            await subscribed(xpub)
            last = encode_batch([stored(words("last", 40))], 1.0, 16, {})
            await xpub.send_multipart((topic, (len(texts) + 1).to_bytes(8, "big"), last))
            await eventually(lambda: matched(index, "pod-a", words("last", 40)) == 2, "live")
            await eventually(lambda: index.blocks("pod-a") == 2 * len(texts) + 2, "replayed")
            stats = subscriber.stats("pod-a")
            assert stats is not None and stats.replayed == len(texts) and stats.malformed == 0
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        router.close(linger=0)
        xpub.close(linger=0)
