"""KV block bookkeeping: chained prefix keys, sharing, tail-first LRU eviction."""

from __future__ import annotations

from policyd.sim.blocks import BlockManager, prefix_keys


def test_prefix_keys_cover_full_blocks_only_and_chain_through_the_prefix() -> None:
    tokens = list(range(40))
    keys = prefix_keys("base", tokens, 16)
    assert len(keys) == 2  # 8 trailing tokens make no key
    assert keys == prefix_keys("base", tokens[:32], 16)
    # the same second block after a different first block is a different key
    changed = prefix_keys("base", [99, *tokens[1:]], 16)
    assert changed[0] != keys[0] and changed[1] != keys[1]
    # the adapter is part of every key
    assert set(prefix_keys("adapter-1", tokens, 16)).isdisjoint(keys)


def test_blocks_are_shared_while_in_use_and_kept_cached_after() -> None:
    manager = BlockManager(4, watermark_blocks=0)
    keys = prefix_keys("base", range(32), 16)
    first, hits = manager.allocate(keys, 2)
    assert hits == 0
    for block, key in zip(first, keys, strict=True):
        manager.register(block, key)
    second, hits = manager.allocate(keys, 3)
    assert hits == 2 and second[:2] == first
    assert manager.num_free == 1
    manager.free(first)
    manager.free(second)
    assert manager.num_free == 4 and manager.usage == 0.0
    assert manager.cached_blocks() == 2


def test_eviction_takes_the_tail_of_the_least_recently_freed_chain_first() -> None:
    manager = BlockManager(3, watermark_blocks=0)
    keys = prefix_keys("base", range(48), 16)
    blocks, _ = manager.allocate(keys, 3)
    for block, key in zip(blocks, keys, strict=True):
        manager.register(block, key)
    manager.free(blocks)
    manager.take_fresh()  # no uncached block left: the chain loses its last block
    _, hits = manager.allocate(keys, 2)
    assert hits == 2


def test_the_watermark_holds_back_admissions_but_not_growth() -> None:
    manager = BlockManager(10, watermark_blocks=2)
    assert manager.can_allocate(8) and not manager.can_allocate(9)
    assert manager.can_append(10)
