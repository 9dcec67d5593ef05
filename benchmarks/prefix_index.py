"""The precise prefix index under a 100-pod pool's KV events, next to the serving path's work.

    python benchmarks/prefix_index.py [--pods 100] [--blocks-per-second 10000] [--seconds 2]
                                      [--rounds 5] [--requests-per-second 200]

Goal (issue 25): the index holds a 100-pod pool's events at 10k blocks/s with the
serving path's p50 unchanged.

A child process runs ``--pods`` of the simulator's real KV-event publishers
(``policyd.sim.kv_events.KvEventPublisher``: a ZMQ PUB socket and a replay socket
each). Every pod first stores one shared system prompt (~1,500 words, 94 blocks of
16 tokens); then, while the load is on, the pool stores ``--blocks-per-second`` new
blocks in all (chains of 5 blocks, one batch per chain, pods in turn) and each pod
evicts as many, oldest first, to stay at its capacity: as many blocks removed as
stored, so the index sees twice that rate of block events.

This process runs what ``policyd serve`` runs in precise mode: a
``KvEventSubscriber`` on every pod's publisher over real ZMQ, applying to a
``PreciseIndex`` on the event loop, and, on the same loop, the serving path's
prefix work for requests that a second child process sends at
``--requests-per-second`` (one UDP datagram each, stamped with the monotonic
clock): a ``PrefixProbe`` of the system prompt plus a question (the simulator's
tokenizer, its keys, the index match over all pods). A request's latency runs
from its sending to its answer, so any time the loop spends applying events
while a request waits shows in it. Rounds alternate no load and load; each
figure is the median over the rounds.

Printed: request latency p50 / p99 without and with the load and their ratio; the
index match alone (keys precomputed, in-call time); the blocks applied per second;
the CPU this process spends per 1,000 block events (CPU with load minus CPU without,
over the block events applied); gaps and clears (a subscriber that falls behind
drops nothing: a backlog waits at each publisher, up to 100,000 messages).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.synchronize
import random
import resource
import socket
import statistics
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from reporting import nearest_rank as percentile

from policyd.extproc.openai import Turn
from policyd.prefix.index import PreciseIndex
from policyd.prefix.probe import PrefixLocator
from policyd.prefix.subscriber import KvEventSubscriber
from policyd.prefix.tokenizers import SimTokenizer
from policyd.sim.blocks import BlocksRemoved, BlocksStored, KvEvent
from policyd.sim.tokenizer import tokenize

MODEL = "meta-llama/Llama-2-7b-hf"
BLOCK = 16
CHAIN = 5  # blocks stored per batch
CAPACITY = 256  # blocks each pod holds besides the system prompt (full within seconds)
TICK_S = 0.01
SYSTEM = Turn("system", (" ".join(f"rule{i} of the house" for i in range(375)),))


@dataclass(frozen=True)
class Pod:
    address: str


# -- the pool's publishers (child process) ----------------------------------------------------


def publish(
    pods: int,
    rate: float,
    endpoints: Any,
    load_on: multiprocessing.synchronize.Event,
    stop: multiprocessing.synchronize.Event,
) -> None:
    asyncio.run(_publish(pods, rate, endpoints, load_on, stop))


async def _publish(
    pods: int,
    rate: float,
    endpoints: Any,
    load_on: multiprocessing.synchronize.Event,
    stop: multiprocessing.synchronize.Event,
) -> None:
    from policyd.sim.kv_events import KvEventPublisher
    from policyd.sim.tokenizer import block_hashes

    publishers = [
        await KvEventPublisher.open(
            host="127.0.0.1",
            port=0,
            replay_port=0,
            topic=f"kv@pod{i}@{MODEL}",
            block_size=BLOCK,
            lora_ids={},
        )
        for i in range(pods)
    ]
    endpoints.put([(p.endpoint, p.replay_endpoint) for p in publishers])
    endpoints.get()  # the subscriber is connected: store the system prompt everywhere
    system = tokenize(f"system: {SYSTEM.texts[0]}")
    hashes = block_hashes(system, BLOCK, MODEL)
    first: list[KvEvent] = [
        BlocksStored(tuple(hashes), None, tuple(system[: len(hashes) * BLOCK]), None)
    ]
    for publisher in publishers:
        publisher.publish(first, time.time())
    rng = random.Random(1)
    held = [deque[int]() for _ in range(pods)]
    serial = 1 << 40
    turn = 0
    due = 0.0
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(TICK_S)
        now = time.perf_counter()
        if not load_on.is_set():
            due, last = 0.0, now
            continue
        due += (now - last) * rate / CHAIN
        last = now
        while due >= 1:
            due -= 1
            pod = turn % pods
            turn += 1
            chain = tuple(range(serial, serial + CHAIN))
            serial += CHAIN
            tokens = tuple(rng.randrange(3, 32000) for _ in range(CHAIN * BLOCK))
            events: list[KvEvent] = [BlocksStored(chain, None, tokens, None)]
            held[pod].extend(chain)
            evicted = tuple(held[pod].popleft() for _ in range(len(held[pod]) - CAPACITY))
            if evicted:
                events.append(BlocksRemoved(evicted))
            publishers[pod].publish(events, time.time())
    for publisher in publishers:
        await publisher.close()


# -- the subscriber and the serving path (this process) ---------------------------------------


@dataclass
class Phase:
    latency_us: list[float]  # sent -> answered
    probe_us: list[float]  # the probe's own time
    match_us: list[float]
    cpu_s: float
    wall_s: float
    blocks: int


def client(port: int, per_second: float, stop: multiprocessing.synchronize.Event) -> None:
    """Requests at a fixed rate: one datagram each, stamped with the monotonic clock."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    due = time.monotonic()
    while not stop.is_set():
        due += 1 / per_second
        time.sleep(max(0.0, due - time.monotonic()))
        sock.sendto(struct.pack("<d", time.monotonic()), ("127.0.0.1", port))
    sock.close()


class Requests(asyncio.DatagramProtocol):
    """Serves each request as it arrives: a probe of the system prompt and a question."""

    def __init__(self, locator: PrefixLocator, pods: list[Pod]) -> None:
        self.locator = locator
        self.pods = pods
        self.names = [pod.address for pod in pods]
        self.keys = locator.probe((SYSTEM, Turn("user", ("warm",)))).keys(MODEL, BLOCK)
        self.phase: Phase | None = None
        self.served = 0

    def datagram_received(self, data: bytes, addr: Any) -> None:
        (sent,) = struct.unpack("<d", data)
        self.served += 1
        turns = (SYSTEM, Turn("user", (f"question {self.served} about the house rules",)))
        began = time.perf_counter()
        result = self.locator.probe(turns).match(MODEL, self.pods)
        ended = time.perf_counter()
        latency = time.monotonic() - sent
        self.locator.index.match(self.keys, self.names)
        matched = time.perf_counter() - ended
        assert result[0][1] > 1000, result[0]  # the system prompt is cached everywhere
        if self.phase is not None:
            self.phase.latency_us.append(latency * 1e6)
            self.phase.probe_us.append((ended - began) * 1e6)
            self.phase.match_us.append(matched * 1e6)


async def measure(requests: Requests, subscriber: KvEventSubscriber, seconds: float) -> Phase:
    """The requests served in the next ``seconds``, the CPU spent and the block events applied."""

    def applied() -> int:
        return sum(s.blocks for p in requests.names if (s := subscriber.stats(p)))

    phase = requests.phase = Phase([], [], [], 0.0, 0.0, 0)
    cpu, wall, blocks = time.process_time(), time.perf_counter(), applied()
    await asyncio.sleep(seconds)
    requests.phase = None
    phase.cpu_s, phase.wall_s = time.process_time() - cpu, time.perf_counter() - wall
    phase.blocks = applied() - blocks
    return phase


async def main(args: argparse.Namespace) -> None:
    context = multiprocessing.get_context("spawn")
    endpoints = context.Queue()
    load_on, stop = context.Event(), context.Event()
    child = context.Process(
        target=publish, args=(args.pods, args.blocks_per_second, endpoints, load_on, stop)
    )
    child.start()
    index = PreciseIndex()
    locator = PrefixLocator(SimTokenizer(), index, BLOCK)
    pairs = await asyncio.to_thread(endpoints.get, True, 60)
    replay = dict(pairs)
    pods = [Pod(f"pod{i}") for i in range(args.pods)]
    subscriber = KvEventSubscriber(index, replay_endpoint=replay.get)
    subscriber.follow({pod.address: events for pod, (events, _) in zip(pods, pairs, strict=True)})
    requests = Requests(locator, pods)
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: requests, local_addr=("127.0.0.1", 0)
    )
    port = transport.get_extra_info("sockname")[1]
    sender = context.Process(target=client, args=(port, args.requests_per_second, stop))
    try:
        while any((s := subscriber.stats(p.address)) is None or not s.connects for p in pods):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # subscriptions reach the publishers
        endpoints.put("go")
        while any(index.blocks(p.address) == 0 for p in pods):
            await asyncio.sleep(0.05)
        sender.start()
        quiet: list[Phase] = []
        loaded: list[Phase] = []
        for _ in range(args.rounds):
            load_on.clear()
            await asyncio.sleep(0.5)  # what was sent is applied
            quiet.append(await measure(requests, subscriber, args.seconds))
            load_on.set()
            # Measured once every pod's cache is full: as many blocks removed as stored.
            while any(index.blocks(p.address) < CAPACITY for p in pods):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            loaded.append(await measure(requests, subscriber, args.seconds))
        load_on.clear()
        report(args, quiet=quiet, loaded=loaded, subscriber=subscriber, index=index, pods=pods)
    finally:
        stop.set()
        transport.close()
        await subscriber.close()
        await asyncio.to_thread(child.join, 10)
        if sender.pid is not None:
            await asyncio.to_thread(sender.join, 10)


def report(
    args: argparse.Namespace,
    *,
    quiet: list[Phase],
    loaded: list[Phase],
    subscriber: KvEventSubscriber,
    index: PreciseIndex,
    pods: list[Pod],
) -> None:
    def median(phases: list[Phase], figure: Any) -> float:
        return statistics.median(figure(phase) for phase in phases)

    q50 = median(quiet, lambda p: percentile(p.latency_us, 0.5))
    l50 = median(loaded, lambda p: percentile(p.latency_us, 0.5))
    q99 = median(quiet, lambda p: percentile(p.latency_us, 0.99))
    l99 = median(loaded, lambda p: percentile(p.latency_us, 0.99))
    p_q = median(quiet, lambda p: percentile(p.probe_us, 0.5))
    p_l = median(loaded, lambda p: percentile(p.probe_us, 0.5))
    m_q = median(quiet, lambda p: percentile(p.match_us, 0.5))
    m_l = median(loaded, lambda p: percentile(p.match_us, 0.5))
    rate = median(loaded, lambda p: p.blocks / p.wall_s)
    # CPU seconds per second with the load minus without, per block event, in ms per 1,000.
    cpu_per_k = statistics.median(
        (on.cpu_s / on.wall_s - off.cpu_s / off.wall_s) / (on.blocks / on.wall_s) * 1e6
        for off, on in zip(quiet, loaded, strict=True)
    )
    stats = [s for p in pods if (s := subscriber.stats(p.address)) is not None]
    print(
        f"{args.pods} pods, {args.blocks_per_second:.0f} blocks stored/s (+ as many removed),"
        f" {args.requests_per_second:.0f} requests/s, {args.rounds} rounds of {args.seconds} s"
    )
    print(f"request (probe: tokenize, keys, match over {args.pods} pods), sent -> answered:")
    print(f"  p50 no load {q50:8.1f} us   load {l50:8.1f} us   ratio {l50 / q50:.2f}")
    print(f"  p99 no load {q99:8.1f} us   load {l99:8.1f} us   ratio {l99 / q99:.2f}")
    ratios = [
        percentile(on.latency_us, 0.5) / percentile(off.latency_us, 0.5)
        for off, on in zip(quiet, loaded, strict=True)
    ]
    print("  p50 ratio per round: " + " ".join(f"{ratio:.2f}" for ratio in ratios))
    print(f"probe's own time p50: no load {p_q:.1f} us, load {p_l:.1f} us")
    print(f"index match alone p50: no load {m_q:.1f} us, load {m_l:.1f} us")
    print(f"block events applied: {rate:,.0f}/s; CPU {cpu_per_k:.2f} ms per 1,000 block events")
    print(
        f"gaps {sum(s.gaps for s in stats)}, clears {sum(s.clears for s in stats)},"
        f" malformed {sum(s.malformed for s in stats)};"
        f" index {sum(index.blocks(p.address) for p in pods):,} blocks;"
        f" max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )
    print(f"goal (p50 unchanged, ratio <= 1.10): {'met' if l50 / q50 <= 1.10 else 'missed'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--blocks-per-second", type=float, default=10_000)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests-per-second", type=float, default=200)
    asyncio.run(main(parser.parse_args()))
