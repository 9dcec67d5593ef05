"""Hostile or huge KV-event feeds against the subscriber, over real ZMQ sockets on loopback.

The pods here are the simulator's real publisher (vLLM's wire format, with its
replay socket) where a real vLLM gets there by itself (sequence numbers in the
millions after weeks of serving), and a raw XPUB socket speaking the same wire
format where only a hostile pod would send it. An XPUB reports each
subscription, so a test sends once the subscriber is listening, without
sleeping for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from policyd.prefix.index import PreciseIndex
from policyd.prefix.keys import block_keys
from policyd.prefix.subscriber import KvEventSubscriber
from policyd.sim.blocks import BlocksRemoved, BlocksStored
from policyd.sim.kv_events import KvEventPublisher, encode_batch
from policyd.sim.tokenizer import block_hashes, tokenize

MODEL = "meta-llama/Llama-2-7b-hf"
TOPIC = f"kv@pod-a@{MODEL}".encode()
WAIT_S = 20.0
FEW_MB = 8 << 20


def words(prefix: str, count: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(count))


def stored(text: str) -> BlocksStored:
    tokens = tokenize(text)
    hashes = block_hashes(tokens, 16, MODEL)
    return BlocksStored(tuple(hashes), None, tuple(tokens[: 16 * len(hashes)]), None)


def matched(index: PreciseIndex, text: str) -> int:
    return index.match(block_keys(tokenize(text), 16, MODEL), ["pod-a"])[0]


async def eventually(condition: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def following(
    index: PreciseIndex, endpoint: str, replay: str | None
) -> AsyncIterator[KvEventSubscriber]:
    subscriber = KvEventSubscriber(index, replay_endpoint=lambda _: replay)
    subscriber.follow({"pod-a": endpoint})
    try:
        yield subscriber
    finally:
        await subscriber.close()


async def received_probe(subscriber: KvEventSubscriber, publisher: KvEventPublisher) -> None:
    """Publish no-op batches until the subscriber has one: its subscription is in place."""

    def received() -> bool:
        stats = subscriber.stats("pod-a")
        return stats is not None and stats.batches > 0

    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not received():
        if loop.time() > deadline:
            raise AssertionError("the subscriber received nothing")
        publisher.publish([BlocksRemoved(())], 0.0)
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def hostile_pod() -> AsyncIterator[tuple[zmq.asyncio.Socket, str]]:
    """An XPUB socket, seen by the subscriber as a pod's event publisher."""
    xpub = zmq.asyncio.Context.instance().socket(zmq.XPUB)
    xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield xpub, f"tcp://127.0.0.1:{port}"
    finally:
        xpub.close(linger=0)


async def subscribed(xpub: zmq.asyncio.Socket) -> None:
    """Wait for a subscription to reach the XPUB (the subscriber connected, or reconnected)."""
    async with asyncio.timeout(WAIT_S):
        while (await xpub.recv())[:1] != b"\x01":
            pass


async def send(xpub: zmq.asyncio.Socket, seq: int, payload: bytes) -> None:
    await xpub.send_multipart((TOPIC, seq.to_bytes(8, "big"), payload))


def peak_since_reset() -> int:
    return tracemalloc.get_traced_memory()[1]


@pytest.fixture
def traced() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield None
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("how", "seq"), [("first message", 5_000_000), ("first message", 10**12), ("gap", 5_000_000)]
)
async def test_a_sequence_number_in_the_millions_allocates_nothing_in_proportion(
    how: str, seq: int, monkeypatch: pytest.MonkeyPatch, traced: None
) -> None:
    publisher = await KvEventPublisher.open(
        host="127.0.0.1", port=0, replay_port=0, topic=TOPIC.decode(), block_size=16, lora_ids={}
    )
    index = PreciseIndex()
    try:
        if how == "first message":  # a pod serving for weeks when policyd starts
            monkeypatch.setattr(publisher, "_seq", seq)
            publisher.publish([stored(words("early", 40))], 1.0)
        async with following(index, publisher.endpoint, publisher.replay_endpoint) as sub:
            tracemalloc.reset_peak()
            await received_probe(sub, publisher)
            if how == "gap":  # five million batches lost on the way
                monkeypatch.setattr(publisher, "_seq", publisher.next_seq + seq)
            publisher.publish([stored(words("late", 40))], 2.0)
            await eventually(lambda: matched(index, words("late", 40)) == 2, "the late batch")
            peak = peak_since_reset()
            stats = sub.stats("pod-a")
            assert stats is not None
            if how == "first message":  # and what the pod still holds is replayed
                assert matched(index, words("early", 40)) == 2 and stats.clears == 0
            else:
                assert stats.gaps == 1 and stats.clears == 1
    finally:
        await publisher.close()
    assert peak < FEW_MB


async def test_a_silent_replay_socket_is_not_waited_for_at_every_gap() -> None:
    context = zmq.asyncio.Context.instance()
    router = context.socket(zmq.ROUTER)  # takes replay requests and never answers
    replay = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    requests: list[list[bytes]] = []

    async def take_requests() -> None:
        while True:
            requests.append(await router.recv_multipart())

    taking = asyncio.create_task(take_requests())
    index = PreciseIndex()
    try:
        async with hostile_pod() as (xpub, endpoint), following(index, endpoint, replay) as sub:
            await subscribed(xpub)
            for n, seq in enumerate((10, 12, 14, 16)):  # every message after a gap
                await send(xpub, seq, encode_batch([stored(words(f"b{n}_", 40))], 1.0, 16, {}))
            await eventually(lambda: matched(index, words("b3_", 40)) == 2, "the last batch")
            assert len(requests) == 1
            stats = sub.stats("pod-a")
            assert stats is not None and stats.gaps == 3 and stats.clears == 3
            assert stats.replay_requests == stats.replay_silent == 1
    finally:
        taking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await taking
        router.close(linger=0)


def flood(first: int, count: int) -> bytes:
    """One batch storing ``count`` one-token blocks, each starting a sequence of its own."""
    event = ["BlockStored", list(range(first, first + count)), None, [7] * count, 1, None]
    packed: bytes = msgpack.packb([1.0, [event], 0])
    return packed


async def test_a_pod_flooding_blocks_is_capped_in_the_precise_index() -> None:
    index = PreciseIndex()
    per_batch, batches = 60_000, 10  # each message well under the 1 MiB limit
    async with hostile_pod() as (xpub, endpoint), following(index, endpoint, None) as sub:
        await subscribed(xpub)
        for n in range(batches):
            await send(xpub, n, flood(n * per_batch, per_batch))
        await eventually(
            lambda: (stats := sub.stats("pod-a")) is not None and stats.batches == batches,
            "the flood",
        )
        assert index.blocks("pod-a") < per_batch * batches
        assert index.blocks("pod-a") == index.max_blocks_per_pod
        skipped = sum(index.skipped("pod-a").values())
        assert skipped == per_batch * batches - index.max_blocks_per_pod


async def test_an_oversized_message_is_dropped_and_the_feed_goes_on() -> None:
    index = PreciseIndex()
    huge = encode_batch([stored(words(f"h{n}_", 800)) for n in range(1000)], 1.0, 16, {})
    assert len(huge) > 2 << 20
    async with hostile_pod() as (xpub, endpoint), following(index, endpoint, None) as sub:
        await subscribed(xpub)
        await send(xpub, 0, huge)
        await subscribed(xpub)  # libzmq dropped the connection with the message; ZMQ is back
        await send(xpub, 1, encode_batch([stored(words("small", 40))], 2.0, 16, {}))
        await eventually(lambda: matched(index, words("small", 40)) == 2, "the next batch")
        assert matched(index, words("h0_", 800)) == 0 and index.blocks("pod-a") == 2
        stats = sub.stats("pod-a")
        assert stats is not None and stats.disconnects >= 1 and stats.batches == 1


async def test_malformed_events_are_logged_rate_limited_without_their_contents(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = 987654321  # a token id: prompt text, which must not reach the logs
    bad_event = ["BlockStored", [1], None, [secret, "not a token"], 16, None, "GPU"]
    index = PreciseIndex()
    with caplog.at_level(logging.INFO, "policyd.prefix"):
        async with hostile_pod() as (xpub, endpoint), following(index, endpoint, None) as sub:
            await subscribed(xpub)
            for seq in range(0, 100, 2):
                await send(xpub, seq, msgpack.packb([1.0, [bad_event], 0]))
                await send(xpub, seq + 1, msgpack.packb({"tokens": [secret] * 3}))
            await send(xpub, 100, encode_batch([stored(words("good", 40))], 1.0, 16, {}))
            await eventually(lambda: matched(index, words("good", 40)) == 2, "the good batch")
            stats = sub.stats("pod-a")
    assert str(secret) not in caplog.text
    malformed = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(malformed) == 1
    assert stats is not None and stats.malformed == 50 and stats.malformed_events == 50
