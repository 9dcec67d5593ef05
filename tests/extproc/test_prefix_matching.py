"""The serving process's prefix matching follows the pool: pods leaving, KV capacity, endpoints."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from policyd.extproc.prefix_matching import PrefixMatching
from policyd.pool.pod import Pod, PoolSnapshot
from policyd.prefix.index import ApproximateIndex
from policyd.prefix.options import DEFAULT_CACHE_BLOCKS, PrefixSettings


class Pool:
    """Publishes a snapshot the test replaces, as the datastore does."""

    def __init__(self, pods: Sequence[Pod]) -> None:
        self.snapshot = self._snap(pods, 1)

    def replace(self, pods: Sequence[Pod]) -> None:
        self.snapshot = self._snap(pods, self.snapshot.version + 1)

    @staticmethod
    def _snap(pods: Sequence[Pod], version: int) -> PoolSnapshot:
        return PoolSnapshot(version, tuple(pods), tuple(pods), True, 0.0, version)


def test_approximate_mode_remembers_each_pod_up_to_its_own_kv_capacity() -> None:
    pool = Pool(
        [
            Pod("big", "10.0.0.1:8000", kv_cache_blocks=700, kv_block_size=16),
            Pod("coarse", "10.0.0.2:8000", kv_cache_blocks=100, kv_block_size=32),
            Pod("silent", "10.0.0.3:8000"),
        ]
    )
    matching = PrefixMatching(PrefixSettings(block_size=16), lambda: pool.snapshot)
    index = matching.locator.index
    assert isinstance(index, ApproximateIndex)
    for address in ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"):
        index.record(address, list(range(5000)))
    assert index.blocks("10.0.0.1:8000") == 700
    assert index.blocks("10.0.0.2:8000") == 200  # 100 blocks of 32 tokens: 200 of 16
    assert index.blocks("10.0.0.3:8000") == DEFAULT_CACHE_BLOCKS


def test_a_fixed_capacity_overrides_what_pods_publish() -> None:
    pool = Pool([Pod("big", "10.0.0.1:8000", kv_cache_blocks=700, kv_block_size=16)])
    matching = PrefixMatching(PrefixSettings(cache_blocks=50), lambda: pool.snapshot)
    index = matching.locator.index
    assert isinstance(index, ApproximateIndex)
    index.record("10.0.0.1:8000", list(range(5000)))
    assert index.blocks("10.0.0.1:8000") == 50


def test_pods_leaving_the_pool_leave_the_approximate_index() -> None:
    pods = [Pod(f"p{i}", f"10.0.0.{i}:8000") for i in range(3)]
    pool = Pool(pods)
    matching = PrefixMatching(PrefixSettings(), lambda: pool.snapshot)
    index = matching.locator.index
    assert isinstance(index, ApproximateIndex)
    for pod in pods:
        index.record(pod.address, [1, 2, 3])
    pool.replace(pods[1:])
    matching.follow_now()
    assert [index.blocks(p.address) for p in pods] == [0, 3, 3]


async def test_precise_mode_follows_each_pods_publisher_by_ip_or_by_its_labels(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pods = [
        Pod("plain", "10.0.0.1:8000", base_model="llama"),
        Pod("labelled", "127.0.0.1:8001", {"policyd/kv-events-port": "6001"}),
        Pod(
            "replays",
            "127.0.0.1:8002",
            {"policyd/kv-events-port": "6003", "policyd/kv-events-replay-port": "6004"},
        ),
        Pod("bad", "10.0.0.4:8000", {"policyd/kv-events-port": "many"}),
    ]
    pool = Pool(pods)
    settings = PrefixSettings(mode="precise", tokenizer="sim", kv_events_port=5557)
    matching = PrefixMatching(settings, lambda: pool.snapshot)
    assert matching.subscriber is not None
    try:
        matching.follow_now()
        assert dict(matching.subscriber.pods) == {
            "10.0.0.1:8000": "tcp://10.0.0.1:5557",
            "127.0.0.1:8001": "tcp://127.0.0.1:6001",
            "127.0.0.1:8002": "tcp://127.0.0.1:6003",
            "10.0.0.4:8000": "tcp://10.0.0.4:5557",
        }
        assert matching._replay_endpoint("tcp://127.0.0.1:6003") == "tcp://127.0.0.1:6004"
        assert matching._replay_endpoint("tcp://10.0.0.1:5557") is None
        # vLLM's default topic names no model: the pod's metrics say which it serves.
        assert matching._model_of("10.0.0.1:8000") == "llama"
        assert matching._model_of("127.0.0.1:8001") is None
        assert "policyd/kv-events-port='many' is no port" in caplog.text
        pool.replace([dataclasses.replace(pods[0], address="10.0.0.9:8000")])
        matching.follow_now()
        assert dict(matching.subscriber.pods) == {"10.0.0.9:8000": "tcp://10.0.0.9:5557"}
    finally:
        await matching.stop()
