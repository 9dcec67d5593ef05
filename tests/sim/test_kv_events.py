"""KV-cache events of a simulated pod over real ZMQ and msgpack, as vLLM publishes them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from policyd.sim import SimPool
from policyd.sim.engine import Engine, SimRequest
from policyd.sim.kv_events import END_SEQ
from policyd.sim.profile import L4_LLAMA2_7B, Profile
from policyd.sim.server import SimServer
from policyd.sim.tokenizer import block_hashes, tokenize

BASE = L4_LLAMA2_7B.base_model
TIME_SCALE = 200.0
RECEIVE_TIMEOUT_S = 30.0  # generous: fails only what never arrives


def words(prefix: str, count: int) -> str:
    """A prompt of ``count`` distinct words: ``count + 1`` tokens with the BOS."""
    return " ".join(f"{prefix}{i}" for i in range(count))


@contextlib.asynccontextmanager
async def started(server: SimServer) -> AsyncIterator[SimServer]:
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class Subscriber:
    """A SUB socket on a pod's publisher that decodes vLLM's three-frame messages."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)

    async def ready(self, pod: SimServer) -> None:
        """Until the pod's publisher has this subscription (ZMQ's slow joiner: a batch
        published before it arrives does not reach this socket)."""
        publisher = pod.driver.kv_events
        assert publisher is not None
        async with asyncio.timeout(RECEIVE_TIMEOUT_S):
            while publisher.subscriptions() < 1:
                await asyncio.sleep(0.01)

    async def receive(self) -> tuple[str, int, bytes, list[Any]]:
        topic, seq, payload = await asyncio.wait_for(
            self.socket.recv_multipart(), RECEIVE_TIMEOUT_S
        )
        return topic.decode(), int.from_bytes(seq, "big"), payload, msgpack.unpackb(payload)

    async def events_until(self, tag: str) -> tuple[list[int], list[list[Any]]]:
        """Sequence numbers and events received up to the first batch holding a ``tag`` event."""
        seqs: list[int] = []
        events: list[list[Any]] = []
        while True:
            _, seq, _, batch = await self.receive()
            seqs.append(seq)
            events += batch[1]
            if any(event[0] == tag for event in batch[1]):
                return seqs, events

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


async def complete(
    client: aiohttp.ClientSession, server: SimServer, model: str, prompt: str
) -> None:
    payload = {"model": model, "prompt": prompt, "max_tokens": 1}
    async with client.post(server.url + "/v1/completions", json=payload) as response:
        assert response.status == 200, await response.text()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


def small_pod(blocks: int = 700, *, replay: bool = True) -> SimServer:
    profile: Profile = L4_LLAMA2_7B.with_changes(num_gpu_blocks=blocks)
    return SimServer(
        profile,
        port=0,
        time_scale=TIME_SCALE,
        adapters=("adapter-0", "adapter-1"),
        kv_events_port=0,
        kv_replay_port=0 if replay else None,
    )


async def test_prefill_publishes_block_stored_with_chained_hashes_and_token_ids(
    client: aiohttp.ClientSession,
) -> None:
    async with started(small_pod()) as pod:
        assert pod.kv_events_endpoint is not None
        sub = Subscriber(pod.kv_events_endpoint)
        try:
            await sub.ready(pod)
            shared = words("sys", 20)  # 21 tokens: one full block shared by both prompts
            first = tokenize(shared + " " + words("a", 20))  # 41 tokens: 2 full blocks
            await complete(client, pod, BASE, shared + " " + words("a", 20))
            topic, seq, _, batch = await sub.receive()
            assert topic == f"kv@{pod.address}@{BASE}"
            assert seq == 0
            ts, events, rank = batch
            assert isinstance(ts, float) and rank == 0
            hashes = block_hashes(first, 16, BASE)
            assert len(hashes) == 2
            assert events == [["BlockStored", hashes, None, first[:32], 16, None, "GPU", None]]

            # Same first block, new second one: only the new block, chained to the cached one.
            second = tokenize(shared + " " + words("b", 20))
            await complete(client, pod, BASE, shared + " " + words("b", 20))
            _, seq, _, (_, events, _) = await sub.receive()
            assert seq == 1
            new = block_hashes(second, 16, BASE)
            assert new[0] == hashes[0] and new[1] != hashes[1]
            assert events == [
                ["BlockStored", new[1:], hashes[0], second[16:32], 16, None, "GPU", None]
            ]

            # An adapter seeds its own chain and names its 1-based LoRA id and its name.
            await complete(client, pod, "adapter-1", shared + " " + words("a", 20))
            _, seq, _, (_, events, _) = await sub.receive()
            assert seq == 2
            lora = block_hashes(first, 16, "adapter-1")
            assert set(lora).isdisjoint(hashes)
            assert events == [["BlockStored", lora, None, first[:32], 16, 2, "GPU", "adapter-1"]]
        finally:
            sub.close()


async def test_eviction_under_pressure_publishes_block_removed_and_seqs_increase(
    client: aiohttp.ClientSession,
) -> None:
    # 12 blocks; each 64-word prompt (65 tokens) holds 5 and leaves 4 cached when done.
    async with started(small_pod(12)) as pod:
        assert pod.kv_events_endpoint is not None
        sub = Subscriber(pod.kv_events_endpoint)
        try:
            await sub.ready(pod)
            prompts = [tokenize(words(f"p{n}_", 64)) for n in range(4)]
            for n in range(4):
                await complete(client, pod, BASE, words(f"p{n}_", 64))
            seqs, events = await sub.events_until("BlockRemoved")
            stored = [event for event in events if event[0] == "BlockStored"]
            removed = [event for event in events if event[0] == "BlockRemoved"]
            assert seqs == list(range(len(seqs)))
            first = block_hashes(prompts[0], 16, BASE)
            assert stored[0][1] == first
            # vLLM sends one hash per eviction; the oldest chain goes first, from its tail.
            assert all(len(event[1]) == 1 and event[2] == "GPU" for event in removed)
            assert removed[0][1] == [first[-1]]
            cached = {h for event in stored for h in event[1]}
            assert {event[1][0] for event in removed} <= cached
        finally:
            sub.close()


async def test_replay_socket_returns_missed_batches(client: aiohttp.ClientSession) -> None:
    async with started(small_pod()) as pod:
        assert pod.kv_events_endpoint is not None and pod.kv_replay_endpoint is not None
        # Nobody listens while three batches go out: a subscriber must ask for them.
        for n in range(3):
            await complete(client, pod, BASE, words(f"r{n}_", 20))
        context = zmq.asyncio.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.connect(pod.kv_replay_endpoint)
        try:
            await dealer.send_multipart((b"", (1).to_bytes(8, "big")))
            replies = []
            while True:
                empty, seq, payload = await asyncio.wait_for(
                    dealer.recv_multipart(), RECEIVE_TIMEOUT_S
                )
                assert empty == b""
                if seq == END_SEQ:
                    assert payload == b""
                    break
                replies.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        finally:
            dealer.close(linger=0)
            context.term()
        assert [seq for seq, _ in replies] == [1, 2]
        for (_, batch), n in zip(replies, (1, 2), strict=True):
            hashes = block_hashes(tokenize(words(f"r{n}_", 20)), 16, BASE)
            assert batch[1][0][:3] == ["BlockStored", hashes, None]


async def test_reset_prefix_cache_publishes_all_blocks_cleared(
    client: aiohttp.ClientSession,
) -> None:
    async with started(small_pod(replay=False)) as pod:
        assert pod.kv_events_endpoint is not None and pod.kv_replay_endpoint is None
        sub = Subscriber(pod.kv_events_endpoint)
        try:
            await sub.ready(pod)
            await complete(client, pod, BASE, words("c", 20))
            async with client.post(pod.url + "/reset_prefix_cache") as response:
                assert response.status == 200
            _, events = await sub.events_until("AllBlocksCleared")
            assert events[-1] == ["AllBlocksCleared"]
            # Nothing is cached any more: the same prompt stores its blocks again.
            await complete(client, pod, BASE, words("c", 20))
            _, _, _, (_, events, _) = await sub.receive()
            assert events[0][0] == "BlockStored"
            assert events[0][1] == block_hashes(tokenize(words("c", 20)), 16, BASE)
        finally:
            sub.close()


async def test_a_restarted_pod_publishes_on_the_same_ports_from_seq_zero(
    client: aiohttp.ClientSession,
) -> None:
    async with started(small_pod()) as pod:
        endpoints = (pod.kv_events_endpoint, pod.kv_replay_endpoint)
        await complete(client, pod, BASE, words("x", 20))
        await pod.go_away()
        await pod.come_back()
        assert (pod.kv_events_endpoint, pod.kv_replay_endpoint) == endpoints
        assert pod.kv_events_endpoint is not None
        sub = Subscriber(pod.kv_events_endpoint)
        try:
            await sub.ready(pod)
            await complete(client, pod, BASE, words("x", 20))  # a fresh engine: stored again
            _, seq, _, (_, events, _) = await sub.receive()
            assert seq == 0 and events[0][0] == "BlockStored"
        finally:
            sub.close()


async def test_events_are_off_by_default_and_a_pool_assigns_port_pairs() -> None:
    async with started(SimServer(port=0)) as pod:
        assert pod.kv_events_endpoint is None and pod.driver.kv_events is None
        assert pod.driver.engine.take_kv_events() == []
    async with SimPool(2, base_port=0, kv_events_port_base=0) as pool:
        endpoints = {s.kv_events_endpoint for s in pool.servers}
        endpoints |= {s.kv_replay_endpoint for s in pool.servers}
        assert None not in endpoints and len(endpoints) == 4
    with pytest.raises(ValueError, match="KV-event ports"):
        SimPool(2, kv_events_port_base=65534)


def test_repeated_prompt_prefills_only_its_uncached_tokens() -> None:
    profile = L4_LLAMA2_7B
    engine = Engine(profile)
    shared = list(range(3, 3 + 1024))  # 64 full blocks
    first = [1, *shared, *range(5000, 5000 + 999)]  # 2024 tokens
    second = [1, *shared, *range(6000, 6000 + 999)]

    def prefill(prompt: list[int], at: float) -> float:
        engine.add(SimRequest(f"r{at}", tuple(prompt), 1), at)
        duration = engine.start_step(at)
        assert duration is not None
        engine.finish_step(at + duration)
        return duration

    cold = prefill(first, 0.0)
    assert cold == pytest.approx(profile.prefill_step_s(len(first)))
    # The repeat: every full block is cached; one token is always recomputed.
    repeat = prefill(first, 10.0)
    cached = len(first) // 16 * 16
    assert repeat == pytest.approx(profile.prefill_step_s(len(first) - cached))
    # A shared system prompt: the cached share (BOS plus 1024 tokens, 64 blocks) is skipped.
    partial = prefill(second, 20.0)
    assert partial == pytest.approx(profile.prefill_step_s(len(second) - 64 * 16))
    assert cold / repeat > 10 and cold / partial > 1.9


def test_tokenizer_and_hashes_do_not_depend_on_the_process() -> None:
    code = (
        "from policyd.sim.tokenizer import block_hashes, tokenize\n"
        "t = tokenize('Hello, world: a shared system prompt of words ' * 4)\n"
        "print(t[:5], block_hashes(t, 16, 'adapter-3'))\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1
