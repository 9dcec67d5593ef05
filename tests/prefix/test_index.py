"""The approximate and the precise prefix index: what they remember, forget and match."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyd.prefix.events import AllBlocksCleared, BlockRemoved, BlockStored
from policyd.prefix.index import ApproximateIndex, PreciseIndex
from policyd.prefix.keys import block_keys
from policyd.sim.tokenizer import block_hashes

BASE = "base-model"
SYSTEM = list(range(1000, 1064))  # 4 blocks of 16 shared by every prompt below


def prompt(question: int, blocks: int = 2) -> list[int]:
    return [*SYSTEM, *range(question * 100, question * 100 + 16 * blocks)]


def keys(tokens: list[int], model: str = BASE) -> tuple[int, ...]:
    return block_keys(tokens, 16, model)


# -- approximate ---------------------------------------------------------------------------------


def test_approximate_matches_the_leading_blocks_each_pod_was_sent() -> None:
    index = ApproximateIndex(1000)
    index.record("a", keys(prompt(1)))
    index.record("b", keys(SYSTEM[:32]))
    assert index.match(keys(prompt(1)), ["a", "b", "c"]) == [6, 2, 0]
    assert index.match(keys(prompt(2)), ["b", "a"]) == [2, 4]
    assert index.match(keys(prompt(1), "adapter-1"), ["a", "b"]) == [0, 0]
    assert index.match((), ["a"]) == [0]
    assert index.match(keys(prompt(1)), []) == []


def test_approximate_forgets_the_least_recently_routed_blocks_tail_first() -> None:
    index = ApproximateIndex(8)
    index.record("a", keys(prompt(1)))  # 6 blocks
    index.record("a", keys(prompt(2)))  # 2 new blocks: 8
    index.record("a", keys(prompt(3)))  # 2 more: prompt 1's two tail blocks go
    assert index.blocks("a") == 8
    assert index.match(keys(prompt(1)), ["a"]) == [4]
    assert index.match(keys(prompt(2)), ["a"]) == [6]
    # Routing prompt 2 again refreshes it: prompt 3's tail goes next.
    index.record("a", keys(prompt(2)))
    index.record("a", keys(prompt(4, blocks=1)))
    assert index.match(keys(prompt(3)), ["a"]) == [5]
    assert index.match(keys(prompt(2)), ["a"]) == [6]


def test_approximate_capacity_may_be_asked_per_pod_and_change() -> None:
    capacity = {"a": 3, "b": 100}
    index = ApproximateIndex(lambda pod: capacity.get(pod, 0))
    for pod in ("a", "b", "c"):
        index.record(pod, keys(prompt(1)))
    assert index.match(keys(prompt(1)), ["a", "b", "c"]) == [3, 6, 0]
    capacity["a"] = 1
    index.record("a", keys(prompt(1)))
    assert index.match(keys(prompt(1)), ["a", "b"]) == [1, 6]


def test_pods_leaving_the_pool_drop_their_entries_and_a_new_pod_starts_empty() -> None:
    index = ApproximateIndex(100)
    for pod in ("a", "b", "c"):
        index.record(pod, keys(prompt(1)))
    index.retain(["b"])
    assert index.match(keys(prompt(1)), ["a", "b", "c"]) == [0, 6, 0]
    assert index.blocks("a") == 0
    # A new pod reuses a freed slot without inheriting anything.
    index.record("d", keys(prompt(2)))
    assert index.match(keys(prompt(1)), ["d", "b"]) == [4, 6]
    index.forget("b")
    index.forget("b")
    assert index.match(keys(prompt(1)), ["b", "d"]) == [0, 4]


PODS = ("a", "b", "c", "d")
PROMPTS = st.lists(st.integers(0, 3), min_size=1, max_size=6).map(
    lambda parts: [t for part in parts for t in range(part * 16, part * 16 + 16)]
)


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 12),
    steps=st.lists(st.tuples(st.sampled_from(PODS), PROMPTS, st.booleans()), max_size=30),
    probe=PROMPTS,
)
def test_approximate_agrees_with_a_plain_lru_model(
    capacity: int, steps: list[tuple[str, list[int], bool]], probe: list[int]
) -> None:
    index = ApproximateIndex(capacity)
    model: dict[str, list[int]] = {}  # pod -> keys, least recently used first
    for pod, tokens, leave in steps:
        if leave:
            index.forget(pod)
            model.pop(pod, None)
            continue
        index.record(pod, keys(tokens))
        lru = model.setdefault(pod, [])
        for key in reversed(keys(tokens)):
            if key in lru:
                lru.remove(key)
            lru.append(key)
        del lru[: max(0, len(lru) - capacity)]
    expected = []
    for pod in PODS:
        held = set(model.get(pod, ()))
        count = 0
        for key in keys(probe):
            if key not in held:
                break
            count += 1
        expected.append(count)
    assert index.match(keys(probe), PODS) == expected


# -- precise -------------------------------------------------------------------------------------


def stored(
    tokens: list[int],
    start: int = 0,
    *,
    model: str = BASE,
    lora_name: str | None = None,
    lora_id: int | None = None,
    medium: str | None = "GPU",
) -> BlockStored:
    """The BlockStored a simulated pod announces for ``tokens``' full blocks from ``start``."""
    hashes = block_hashes(tokens, 16, model)
    end = len(hashes)
    return BlockStored(
        tuple(hashes[start:]),
        hashes[start - 1] if start else None,
        tuple(tokens[start * 16 : end * 16]),
        16,
        lora_id,
        medium,
        lora_name,
        BASE,
    )


def test_precise_keys_the_announced_blocks_as_requests_key_prompts() -> None:
    index = PreciseIndex()
    index.apply("a", [stored(prompt(1))])
    index.apply("b", [stored(prompt(2)[:64]), stored(prompt(2), 4)])  # chained from its parent
    assert index.match(keys(prompt(1)), ["a", "b"]) == [6, 4]
    assert index.match(keys(prompt(2)), ["a", "b"]) == [4, 6]
    assert index.block_size("a") == 16 and index.block_size("c") is None
    assert index.blocks("b") == 6


def test_precise_removed_and_cleared_blocks_leave_the_index() -> None:
    index = PreciseIndex()
    hashes = block_hashes(prompt(1), 16, BASE)
    index.apply("a", [stored(prompt(1)), BlockRemoved((hashes[-1], 12345), "GPU")])
    assert index.match(keys(prompt(1)), ["a"]) == [5]
    index.apply("a", [BlockRemoved((hashes[1],), "GPU")])  # a hole: only the head leads
    assert index.match(keys(prompt(1)), ["a"]) == [1]
    index.apply("b", [stored(prompt(1))])
    index.apply("a", [AllBlocksCleared()])
    assert index.match(keys(prompt(1)), ["a", "b"]) == [0, 6]
    assert index.blocks("a") == 0
    index.clear("b")
    assert index.match(keys(prompt(1)), ["b"]) == [0]
    index.apply("b", [stored(prompt(1))])  # still followed after a clear
    index.forget("b")
    assert index.match(keys(prompt(1)), ["b"]) == [0] and index.blocks("b") == 0


def test_precise_adapters_seed_their_chain_with_their_name() -> None:
    index = PreciseIndex()
    index.apply("a", [stored(prompt(1), model="adapter-2", lora_name="adapter-2", lora_id=2)])
    assert index.match(keys(prompt(1), "adapter-2"), ["a"]) == [6]
    assert index.match(keys(prompt(1)), ["a"]) == [0]


def test_precise_skips_what_it_cannot_key_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    index = PreciseIndex()
    tokens = prompt(1)
    bad = stored(tokens)
    short = BlockStored(bad.block_hashes, None, bad.token_ids[:-1], 16, None, "GPU", None, BASE)
    with caplog.at_level(logging.WARNING, "policyd.prefix.index"):
        index.apply(
            "a",
            [
                short,
                stored(tokens, 4),  # its parent was never announced
                stored(tokens, model="adapter-1", lora_id=1),  # an adapter named by id only
                stored(tokens, model="adapter-1", lora_id=1),
                stored(tokens, medium="CPU"),  # another tier is not the GPU prefix cache
                BlockStored(bad.block_hashes, None, bad.token_ids, 16),  # no topic, no model
            ],
        )
    assert index.match(keys(tokens), ["a"]) == [0]
    assert index.skipped("a") == {
        "token ids do not fill the blocks": 6,
        "parent block never announced": 2,
        "an adapter named only by its id": 12,
        "the base model unnamed (the topic names none)": 6,
    }
    assert len(caplog.records) == 4 and "adapter named only by its id" in caplog.text


def test_precise_replays_are_idempotent_and_shared_keys_are_counted() -> None:
    index = PreciseIndex()
    event = stored(prompt(1))
    index.apply("a", [event, event])
    assert index.blocks("a") == 6
    # The same blocks under other engine hashes (a cache salt differs): removing one copy
    # leaves the blocks held.
    salted = BlockStored(
        tuple(h + 1 for h in event.block_hashes if isinstance(h, int)),
        None,
        event.token_ids,
        16,
        None,
        "GPU",
        None,
        BASE,
    )
    index.apply("a", [salted, BlockRemoved(event.block_hashes, "GPU")])
    assert index.match(keys(prompt(1)), ["a"]) == [6]
    index.apply("a", [BlockRemoved(salted.block_hashes, "GPU")])
    assert index.match(keys(prompt(1)), ["a"]) == [0]
    # Another medium's removal does not touch the GPU blocks.
    index.apply("a", [event, BlockRemoved(event.block_hashes, "CPU")])
    assert index.match(keys(prompt(1)), ["a"]) == [6]


def test_precise_caps_each_pods_blocks_and_indexes_again_once_some_leave() -> None:
    index = PreciseIndex(max_blocks_per_pod=7)
    index.apply("a", [stored(prompt(1)), stored(prompt(2))])  # 4 shared blocks, 2 each
    index.apply("b", [stored(prompt(2))])
    # The second prompt's last block is past the cap: not indexed.
    assert index.blocks("a") == 7 and index.match(keys(prompt(2)), ["a", "b"]) == [5, 6]
    assert index.skipped("a") == {"over the cap of 7 blocks": 1}
    own = block_hashes(prompt(1), 16, BASE)[4:]
    index.apply("a", [BlockRemoved(tuple(own), "GPU"), stored(prompt(3))])
    assert index.blocks("a") == 7 and index.match(keys(prompt(3)), ["a"]) == [6]
