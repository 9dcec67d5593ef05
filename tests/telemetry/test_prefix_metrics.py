"""The prefix index's health on /metrics: a real KV-event feed over ZMQ, scraped over HTTP."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import replace

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from policyd.pool.pod import EMPTY_SNAPSHOT, Pod
from policyd.prefix.index import ApproximateIndex, PreciseIndex
from policyd.prefix.subscriber import KvEventSubscriber
from policyd.sim.blocks import BlocksStored
from policyd.sim.kv_events import encode_batch
from policyd.sim.profile import L4_LLAMA2_7B
from policyd.sim.tokenizer import block_hashes, tokenize
from policyd.telemetry import PrefixCollector, start_metrics_server

BASE = L4_LLAMA2_7B.base_model
POD = Pod("vllm-0", "10.0.0.1:8000")
GONE = Pod("vllm-9", "10.0.0.9:8000")  # followed, but no longer in the pool
SNAPSHOT = replace(EMPTY_SNAPSHOT, pods=(POD,))


def stored(text: str) -> BlocksStored:
    tokens = tokenize(text)
    hashes = block_hashes(tokens, 16, BASE)
    return BlocksStored(tuple(hashes), None, tuple(tokens[: 16 * len(hashes)]), None)


def scrape(registry: CollectorRegistry) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of a real scrape over HTTP: name -> labels -> value."""
    server = start_metrics_server("127.0.0.1", 0, registry)
    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.close()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


async def until(condition: object, what: str) -> None:
    assert callable(condition)
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within 5 s: {what}")


async def test_blocks_batches_gaps_clears_and_lag_per_pod() -> None:
    index = PreciseIndex()
    subscriber = KvEventSubscriber(index)
    socket = zmq.asyncio.Context.instance().socket(zmq.XPUB)
    socket.setsockopt(zmq.XPUB_VERBOSE, 1)
    endpoint = f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"
    registry = CollectorRegistry()
    registry.register(PrefixCollector(index, subscriber, lambda: SNAPSHOT))
    topic = f"kv@{POD.address}@{BASE}".encode()

    async def send(seq: int, text: str, ts: float) -> None:
        payload = encode_batch([stored(text)], ts, 16, {})
        await socket.send_multipart((topic, seq.to_bytes(8, "big"), payload))

    try:
        subscriber.follow({POD.address: endpoint, GONE.address: "tcp://127.0.0.1:1"})
        async with asyncio.timeout(5):
            while (await socket.recv())[:1] != b"\x01":  # the subscription arrived
                pass
        await send(0, " ".join(f"a{i}" for i in range(40)), time.time() - 30.0)
        await until(lambda: index.blocks(POD.address) == 2, "the first batch")
        samples = scrape(registry)
        pod = (("model_server_endpoint", "vllm-0"),)
        assert samples["policyd_prefix_index_blocks"] == {pod: 2}  # the pod that left: none
        assert samples["policyd_prefix_kv_event_batches_total"] == {pod: 1}
        assert samples["policyd_prefix_kv_event_gaps_total"] == {pod: 0}
        assert 30.0 <= samples["policyd_prefix_kv_event_lag_seconds"][pod] < 300.0

        # Batches 1..2 never come and the pod has no replay socket: a gap, the pod cleared.
        await send(3, " ".join(f"b{i}" for i in range(40)), time.time())
        await until(lambda: index.blocks(POD.address) == 2 and batches(subscriber) == 2, "gap")
        samples = scrape(registry)
        assert samples["policyd_prefix_kv_event_gaps_total"] == {pod: 1}
        assert samples["policyd_prefix_kv_event_clears_total"] == {pod: 1}
        assert samples["policyd_prefix_kv_event_replayed_batches_total"] == {pod: 0}
        assert samples["policyd_prefix_kv_event_lag_seconds"][pod] < 30.0
    finally:
        await subscriber.close()
        socket.close(linger=0)


def batches(subscriber: KvEventSubscriber) -> int:
    stats = subscriber.stats(POD.address)
    return 0 if stats is None else stats.batches


def test_approximate_mode_reports_the_blocks_and_no_feeds() -> None:
    index = ApproximateIndex(100)
    index.record(POD.address, [1, 2, 3])
    registry = CollectorRegistry()
    registry.register(PrefixCollector(index, None, lambda: SNAPSHOT))
    samples = scrape(registry)
    assert samples["policyd_prefix_index_blocks"] == {(("model_server_endpoint", "vllm-0"),): 3}
    assert not [name for name in samples if name.startswith("policyd_prefix_kv_event")]
