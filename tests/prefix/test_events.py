"""Decoding vLLM's KV-event payloads: every published shape, and bad input never raising."""

from __future__ import annotations

import logging

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyd.prefix.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    base_model_of,
    decode_batch,
)
from policyd.sim.blocks import AllBlocksCleared as SimCleared
from policyd.sim.blocks import BlocksRemoved, BlocksStored, KvEvent
from policyd.sim.kv_events import encode_batch


def payload(*events: object, ts: float = 12.5) -> bytes:
    packed: bytes = msgpack.packb([ts, list(events), 0])
    return packed


def test_the_simulators_batches_decode_with_the_adapter_name() -> None:
    events: list[KvEvent] = [
        BlocksStored((11, 12), None, tuple(range(32)), None),
        BlocksStored((13,), 12, tuple(range(16)), "adapter-2"),
        BlocksRemoved((11,)),
        SimCleared(),
    ]
    batch = decode_batch(encode_batch(events, 3.0, 16, {"adapter-2": 2}), "llama")
    assert batch is not None and batch.ts == 3.0
    base, adapter, removed, cleared = batch.events
    assert base == BlockStored((11, 12), None, tuple(range(32)), 16, None, "GPU", None, "llama")
    assert adapter == BlockStored((13,), 12, tuple(range(16)), 16, 2, "GPU", "adapter-2", "llama")
    assert (base.served_as, adapter.served_as) == ("llama", "adapter-2")
    assert removed == BlockRemoved((11,), "GPU") and cleared == AllBlocksCleared()


def test_older_and_newer_block_stored_shapes_decode() -> None:
    oldest = ["BlockStored", [1], None, [5] * 16, 16, None]  # before `medium`
    by_id = ["BlockStored", [2], None, [5] * 16, 16, 3, "GPU"]  # before `lora_name`
    newest = ["BlockStored", [3], 2, [5] * 16, 16, 3, "GPU", "a", [None], 0, None, None]
    bytes_hashes = ["BlockStored", [b"\x01" * 32], None, [5] * 16, 16, None, "GPU", None]
    batch = decode_batch(
        payload(oldest, by_id, newest, bytes_hashes, ["BlockRemoved", [1]]), "base"
    )
    assert batch is not None
    first, second, third, fourth, removed = batch.events
    assert isinstance(first, BlockStored) and first.medium is None and first.served_as == "base"
    assert isinstance(second, BlockStored) and second.served_as is None  # an adapter by id only
    assert isinstance(third, BlockStored) and third.served_as == "a"
    assert third.parent_block_hash == 2
    assert isinstance(fourth, BlockStored) and fourth.block_hashes == (b"\x01" * 32,)
    assert removed == BlockRemoved((1,), None)


def test_malformed_events_are_skipped_and_logged_the_rest_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    good = ["BlockRemoved", [7], "GPU"]
    bad = [
        ["BlockStored", [1], None, [1, "x"], 16, None, "GPU"],  # a token id that is not an int
        ["BlockStored", [1], None, [1], 0, None, "GPU"],  # no block size
        ["BlockStored", [True], None, [1], 16, None, "GPU"],  # a bool is no hash
        ["BlockStored", [1], None, [1]],  # too short
        ["BlockRemoved", "7"],
        ["BlockEvicted", [1]],  # an unknown tag
        "AllBlocksCleared",
        [],
    ]
    with caplog.at_level(logging.WARNING, "policyd.prefix.events"):
        batch = decode_batch(payload(*bad, good))
    assert batch is not None and batch.events == (BlockRemoved((7,), "GPU"),)
    assert len(caplog.records) == len(bad)


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0]), msgpack.packb(["t", []])],
)
def test_a_payload_that_is_no_batch_is_none(raw: bytes, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "policyd.prefix.events"):
        assert decode_batch(raw) is None
    assert caplog.records


MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=5)
    | st.binary(),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64) | MSGPACK_VALUES.map(msgpack.packb))
def test_decoding_never_raises(raw: bytes) -> None:
    decode_batch(raw)


@settings(max_examples=300, deadline=None)
@given(events=st.lists(MSGPACK_VALUES, max_size=5))
def test_decoding_any_events_never_raises(events: list[object]) -> None:
    batch = decode_batch(msgpack.packb([1.0, events, 0]))
    assert batch is not None and len(batch.events) <= len(events)


def test_the_topic_names_the_base_model_in_llm_d_convention() -> None:
    assert base_model_of(b"kv@10.0.0.1:8000@meta-llama/Llama-2-7b") == "meta-llama/Llama-2-7b"
    assert base_model_of(b"kv@pod@model@with@ats") == "model@with@ats"
    for topic in (b"", b"kv", b"kv@pod", b"kv@pod@", b"other@pod@model", b"\xff@\xff@\xff"):
        assert base_model_of(topic) is None
