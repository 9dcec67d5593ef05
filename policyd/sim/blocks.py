"""The GPU KV cache of one pod: fixed-size blocks, automatic prefix caching, LRU eviction.

Modelled on vLLM's block manager with prefix caching: a sequence holds
``ceil(tokens / block_size)`` blocks; every *full* prompt block has a key
chained from the key of the block before it and the LoRA adapter, so a block
is shared only when the whole prefix up to it and the adapter match. Blocks
whose last user finished keep their key and stay reusable until a fresh block
is needed and none is left uncached; then the least recently freed cached
block is evicted. A freed sequence releases its blocks tail first, so a chain
is evicted from its end and its shared head survives longest.

The keys are ``policyd.sim.tokenizer.block_hashes``, the hashes the pod's KV
events announce. When asked to (``record``), the manager notes every eviction
as a ``BlocksRemoved``; the engine notes what it stores (``BlocksStored``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from policyd.sim.tokenizer import block_hashes


def prefix_keys(model: str, tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained cache keys of the full blocks of ``tokens`` served as ``model`` (or adapter)."""
    return tuple(block_hashes(tokens, block_size, model))


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive full blocks of one sequence entered the prefix cache (vLLM's ``BlockStored``)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None  # the block before the first one; None at a sequence's start
    token_ids: tuple[int, ...]
    adapter: str | None


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Cached blocks were evicted (vLLM's ``BlockRemoved``)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset (vLLM's ``AllBlocksCleared``)."""


KvEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


class BlockManager:
    """Allocation, sharing and eviction of a fixed pool of KV blocks."""

    def __init__(self, num_blocks: int, watermark_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._watermark_blocks = watermark_blocks
        self._uncached_free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcount = [0] * num_blocks
        self._key_of: list[int | None] = [None] * num_blocks
        self._block_of: dict[int, int] = {}
        # Cached blocks nobody uses, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # KV events since the last drain; None (the default) records nothing.
        self.record: list[KvEvent] | None = None

    @property
    def num_free(self) -> int:
        """Blocks a new allocation may take: never used, or cached and unused."""
        return len(self._uncached_free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, as ``vllm:kv_cache_usage_perc`` reports it."""
        return 1.0 - self.num_free / self.num_blocks

    def can_allocate(self, blocks: int) -> bool:
        """Whether a waiting sequence needing ``blocks`` may be admitted (keeps the watermark)."""
        return self.num_free - blocks >= self._watermark_blocks

    def can_append(self, blocks: int) -> bool:
        """Whether running sequences may grow by ``blocks`` blocks."""
        return blocks <= self.num_free

    def allocate(self, keys: Sequence[int], total_blocks: int) -> tuple[list[int], int]:
        """Blocks for a sequence: the cached run of ``keys`` first, fresh blocks after.

        Returns the block ids and how many leading blocks were prefix-cache hits.
        """
        blocks: list[int] = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            if self._refcount[block] == 0:
                del self._evictable[block]
            self._refcount[block] += 1
            blocks.append(block)
        hits = len(blocks)
        while len(blocks) < total_blocks:
            blocks.append(self.take_fresh())
        return blocks, hits

    def cached_run(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are cached (a prefix-cache look-up that takes nothing)."""
        hits = 0
        for key in keys:
            if key not in self._block_of:
                break
            hits += 1
        return hits

    def allocation_cost(self, hit_keys: Sequence[int], total_blocks: int) -> int:
        """Free blocks ``allocate(hit_keys, total_blocks)`` would consume: fresh ones, and
        cached hits nobody holds (they leave the evictable pool)."""
        idle_hits = sum(1 for key in hit_keys if self._refcount[self._block_of[key]] == 0)
        return total_blocks - len(hit_keys) + idle_hits

    def take_fresh(self) -> int:
        """One empty block, evicting the least recently freed cached block if needed."""
        if self._uncached_free:
            block = self._uncached_free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            key = self._key_of[block]
            assert key is not None
            del self._block_of[key]
            self._key_of[block] = None
            if self.record is not None:
                self.record.append(BlocksRemoved((key,)))
        self._refcount[block] = 1
        return block

    def register(self, block: int, key: int) -> bool:
        """Make a computed full block findable by ``key`` (first writer wins); whether it was."""
        if key not in self._block_of and self._key_of[block] is None:
            self._block_of[key] = block
            self._key_of[block] = key
            return True
        return False

    def free(self, blocks: Sequence[int]) -> None:
        """Release one sequence's hold on its blocks, tail first."""
        for block in reversed(blocks):
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                if self._key_of[block] is None:
                    self._uncached_free.append(block)
                else:
                    self._evictable[block] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's ``reset_prefix_cache``: only when none is in use."""
        if len(self._uncached_free) + len(self._evictable) < self.num_blocks:
            return False
        for block in self._evictable:
            self._key_of[block] = None
            self._uncached_free.append(block)
        self._evictable.clear()
        self._block_of.clear()
        if self.record is not None:
            self.record.append(AllBlocksCleared())
        return True

    def cached_blocks(self) -> int:
        """Blocks currently findable by key (in use or evictable)."""
        return len(self._block_of)
