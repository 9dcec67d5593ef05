"""Decoding vLLM's KV-event payloads: every published shape, and bad input never raising."""

from __future__ import annotations

import logging
import tracemalloc

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


def test_malformed_events_are_skipped_and_counted_the_rest_kept(
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
    with caplog.at_level(logging.DEBUG, "policyd.prefix"):
        batch = decode_batch(payload(*bad, good))
    assert batch is not None and batch.events == (BlockRemoved((7,), "GPU"),)
    assert batch.skipped == len(bad)
    assert not caplog.records  # the subscriber logs per pod, without the contents


def test_a_parent_hash_of_zero_starts_a_sequence_as_llm_d_encoders_write_it() -> None:
    # llm-d's encoders (the inference-sim's array format) write EmptyBlockHash, 0, where
    # vLLM writes nil; read as a hash, every first block would chain to a block never seen.
    batch = decode_batch(payload(["BlockStored", [7, 8], 0, [5] * 32, 16, None, "GPU"]), "base")
    assert batch is not None
    (stored,) = batch.events
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert stored.served_as == "base"


def test_events_encoded_as_maps_decode_as_their_arrays_do() -> None:
    # vLLM PR #42892's encoding (the inference-sim's --use-vllm-map-event-format): each
    # event a map of its field names, tagged under "type"; absent fields take defaults.
    stored = {
        "type": "BlockStored",
        "block_hashes": [3],
        "parent_block_hash": 2,
        "token_ids": [5] * 16,
        "block_size": 16,
        "medium": "GPU",
        "lora_name": "a",
        "lora_id": 1,
        "extra_keys": [None],
    }
    first = {"type": "BlockStored", "block_hashes": [2], "token_ids": [4] * 16, "block_size": 16}
    removed = {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}
    batch = decode_batch(payload(first, stored, removed, {"type": "AllBlocksCleared"}), "base")
    assert batch is not None and batch.skipped == 0
    assert batch.events == (
        BlockStored((2,), None, (4,) * 16, 16, None, None, None, "base"),
        BlockStored((3,), 2, (5,) * 16, 16, 1, "GPU", "a", "base"),
        BlockRemoved((3,), "GPU"),
        AllBlocksCleared(),
    )
    malformed = [
        {"block_hashes": [1]},  # no tag
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1] * 16},  # no block size
        {"type": "BlockEvicted"},
        {b"type": "AllBlocksCleared"},  # a key that is no string
    ]
    batch = decode_batch(payload(*malformed, removed))
    assert batch is not None and batch.events == (BlockRemoved((3,), "GPU"),)
    assert batch.skipped == len(malformed)


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0]), msgpack.packb(["t", []])],
)
def test_a_payload_that_is_no_batch_is_none(raw: bytes) -> None:
    assert decode_batch(raw) is None


MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=5)
    | st.binary(),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=30,
)
# msgpack items that cost the most Python objects per payload byte: a tuple per byte of
# nested one-element arrays, a new str per 3 bytes, a new int per 2, a float per 5.
COSTLY_ITEMS = st.sampled_from(
    [b"\x91" * depth + b"\x01" for depth in (1, 2, 8, 64)]
    + [b"\xa2ab", b"\xcc\xff", b"\xcd\x10\x00", b"\xca\x3f\xc0\x00\x00", b"\x80", b"\xc4\x01x"]
)
# Python objects decoding may allocate per payload byte, at most (measured worst, nested
# one-element arrays: ~38), and a constant for the decoder's own frames.
BYTES_PER_PAYLOAD_BYTE = 64
ALLOCATION_SLACK = 16_384


def allocated_by_decoding(raw: bytes) -> int:
    """Peak bytes of Python objects ``decode_batch(raw)`` allocates (tracemalloc)."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        decode_batch(raw, "model")
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        if not tracing:
            tracemalloc.stop()


def within_bound(raw: bytes) -> bool:
    return allocated_by_decoding(raw) <= BYTES_PER_PAYLOAD_BYTE * len(raw) + ALLOCATION_SLACK


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=256) | MSGPACK_VALUES.map(msgpack.packb))
def test_decoding_any_bytes_never_raises_nor_allocates_beyond_a_bound(raw: bytes) -> None:
    assert within_bound(raw)


@settings(max_examples=300, deadline=None)
@given(events=st.lists(MSGPACK_VALUES, max_size=5))
def test_decoding_any_events_never_raises(events: list[object]) -> None:
    batch = decode_batch(msgpack.packb([1.0, events, 0]))
    assert batch is not None and len(batch.events) + batch.skipped == len(events)


@settings(max_examples=40, deadline=None)
@given(
    items=st.lists(COSTLY_ITEMS, min_size=1, max_size=20_000),
    claimed=st.integers(0, 2**32 - 1),
    where=st.sampled_from(["events", "event", "tokens"]),
)
def test_costly_or_lying_payloads_allocate_in_proportion_to_their_length(
    items: list[bytes], claimed: int, where: str
) -> None:
    # An array of costly items, in each place the decoder walks; a second array claims
    # any length (up to 2**32) over the same bytes, which msgpack refuses to believe.
    array = b"\xdd" + len(items).to_bytes(4, "big") + b"".join(items)
    lying = b"\xdd" + claimed.to_bytes(4, "big") + b"".join(items)
    for body in (array, lying):
        if where == "events":
            raw = b"\x93\xcb" + b"\0" * 8 + body + b"\x00"
        elif where == "event":
            raw = b"\x93\x00\x91" + body + b"\x00"
        else:
            head = msgpack.packb(["BlockStored", [1], None])
            raw = b"\x93\x00\x91\x96" + head[1:] + body + b"\x10\xc0\x00"
        assert within_bound(raw)


HASHES = st.integers(0, 2**64 - 1)
NONZERO_HASHES = st.integers(1, 2**64 - 1)


@st.composite
def sim_events(draw: st.DrawFn) -> list[KvEvent]:
    events: list[KvEvent] = []
    for kind in draw(st.lists(st.sampled_from(["stored", "removed", "cleared"]), max_size=6)):
        if kind == "stored":
            hashes = draw(st.lists(HASHES, min_size=1, max_size=4))
            tokens = draw(
                st.lists(
                    st.integers(0, 2**31 - 1), min_size=16 * len(hashes), max_size=16 * len(hashes)
                )
            )
            parent = draw(st.none() | NONZERO_HASHES)  # 0 is no parent (llm-d's)
            adapter = draw(st.none() | st.sampled_from(["adapter-1", "adapter-2"]))
            events.append(BlocksStored(tuple(hashes), parent, tuple(tokens), adapter))
        elif kind == "removed":
            events.append(BlocksRemoved(tuple(draw(st.lists(HASHES, max_size=4)))))
        else:
            events.append(SimCleared())
    return events


@settings(max_examples=200, deadline=None)
@given(events=sim_events(), ts=st.floats(0, 2e9))
def test_well_formed_batches_round_trip(events: list[KvEvent], ts: float) -> None:
    lora_ids = {"adapter-1": 1, "adapter-2": 2}
    batch = decode_batch(encode_batch(events, ts, 16, lora_ids), "base")
    assert batch is not None and batch.ts == ts and batch.skipped == 0
    expected: list[object] = []
    for event in events:
        if isinstance(event, BlocksStored):
            lora_id = None if event.adapter is None else lora_ids[event.adapter]
            expected.append(
                BlockStored(
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    16,
                    lora_id,
                    "GPU",
                    event.adapter,
                    "base",
                )
            )
        elif isinstance(event, BlocksRemoved):
            expected.append(BlockRemoved(event.block_hashes, "GPU"))
        else:
            expected.append(AllBlocksCleared())
    assert list(batch.events) == expected


def test_the_topic_names_the_base_model_in_llm_d_convention() -> None:
    assert base_model_of(b"kv@10.0.0.1:8000@meta-llama/Llama-2-7b") == "meta-llama/Llama-2-7b"
    assert base_model_of(b"kv@pod@model@with@ats") == "model@with@ats"
    for topic in (b"", b"kv", b"kv@pod", b"kv@pod@", b"other@pod@model", b"\xff@\xff@\xff"):
        assert base_model_of(topic) is None
