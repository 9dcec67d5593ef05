"""Which pods hold which prompt blocks: two indexes answering the same question.

Both map a block key (``policyd.prefix.keys``) to the pods holding it, as a
bit mask: each pod the index knows owns one bit. ``match`` walks a request's
keys in order with the mask of pods still matching, so a step costs one dict
lookup and one integer AND however many pods there are, and the walk stops at
the first block no remaining pod holds. Nothing it allocates grows with the
index.

- ``ApproximateIndex`` learns from policyd's own routing: the keys of every
  request it sent to a pod (``record``), bounded per pod in blocks, least
  recently routed forgotten first.
- ``PreciseIndex`` learns from the pods' KV-cache events (``apply``): it maps
  each pod's engine block hashes to policyd keys, recomputed from the token ids
  the events carry, so it is bounded by what the pods hold.

Everything runs on the event loop: a match never waits and never sees a half
applied event (events are applied between requests, in slices).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from policyd.prefix.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KvEvent,
)
from policyd.prefix.keys import chain_key, root_key

_log = logging.getLogger(__name__)

_GPU: Final = "GPU"
# Blocks indexed per pod at most, whatever a pod announces (~140 bytes each, so
# ~75 MB): twice the largest GPU KV caches in blocks of 16 tokens (a sub-1B
# model on an 80 GB GPU holds ~250,000), so only a pod announcing more blocks
# than it can hold reaches it.
MAX_BLOCKS_PER_POD: Final = 1 << 19


class PrefixIndex(Protocol):
    """Leading prompt blocks each pod holds (or is likely to hold)."""

    def match(self, keys: Sequence[int], pods: Sequence[str]) -> list[int]:
        """Leading blocks of ``keys`` held, per pod, in ``pods`` order."""
        ...

    def forget(self, pod: str) -> None:
        """Drop a pod that left the pool."""
        ...

    def block_size(self, pod: str) -> int | None:
        """The block size ``pod`` announced, or None: the locator's own applies."""
        ...

    def block_sizes(self) -> Collection[int]:
        """Every block size a pod announced (empty when none did)."""
        ...


class _Holders:
    """Block key -> bit mask of the pods holding it, and the walk that matches a prompt."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._bits: dict[str, int] = {}
        self._free_bits: list[int] = []

    def match(self, keys: Sequence[int], pods: Sequence[str]) -> list[int]:
        bits = self._bits
        alive = 0
        for pod in pods:
            alive |= bits.get(pod, 0)
        depth = 0
        dropped_at: dict[int, int] = {}  # a pod's bit -> blocks it had when it stopped matching
        holders = self._holders
        for key in keys:
            if not alive:
                break
            still = alive & holders.get(key, 0)
            if still != alive:
                dropped = alive ^ still
                while dropped:
                    lowest = dropped & -dropped
                    dropped_at[lowest] = depth
                    dropped ^= lowest
                alive = still
            if alive:
                depth += 1
        return [dropped_at.get(bit, depth) if (bit := bits.get(pod, 0)) else 0 for pod in pods]

    def _bit(self, pod: str) -> int:
        bit = self._bits.get(pod)
        if bit is None:
            bit = 1 << (self._free_bits.pop() if self._free_bits else len(self._bits))
            self._bits[pod] = bit
        return bit

    def _release(self, pod: str) -> None:
        bit = self._bits.pop(pod, None)
        if bit is not None:
            self._free_bits.append(bit.bit_length() - 1)

    def _add(self, key: int, bit: int) -> None:
        self._holders[key] = self._holders.get(key, 0) | bit

    def _discard(self, key: int, bit: int) -> None:
        held = self._holders.get(key, 0) & ~bit
        if held:
            self._holders[key] = held
        else:
            self._holders.pop(key, None)

    def _holds(self, key: int, bit: int) -> bool:
        return bool(self._holders.get(key, 0) & bit)


class ApproximateIndex(_Holders):
    """The blocks policyd sent to each pod, least recently routed forgotten first.

    ``capacity_blocks`` bounds each pod's entries: an int for every pod, or a
    callable asked at every ``record`` (so a capacity learned later, e.g. from
    ``vllm:cache_config_info``'s ``num_gpu_blocks``, applies from then on).
    """

    def __init__(self, capacity_blocks: Callable[[str], int] | int) -> None:
        super().__init__()
        self._capacity = capacity_blocks
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def block_size(self, pod: str) -> int | None:
        return None

    def block_sizes(self) -> Collection[int]:
        return ()

    def record(self, pod: str, keys: Sequence[int]) -> None:
        """``pod`` was sent a prompt of these ``keys``: it holds them now, most recently used.

        The keys are refreshed tail first, so the prompt's head is the most recent
        and its tail goes first, as a pod frees a sequence's blocks tail first.
        """
        capacity = self._capacity(pod) if callable(self._capacity) else self._capacity
        if capacity <= 0 or not keys:
            return
        bit = self._bit(pod)
        lru = self._lru.setdefault(pod, OrderedDict())
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                self._add(key, bit)
        while len(lru) > capacity:
            key, _ = lru.popitem(last=False)
            self._discard(key, bit)

    def blocks(self, pod: str) -> int:
        """Blocks remembered for ``pod``."""
        return len(self._lru.get(pod, ()))

    def forget(self, pod: str) -> None:
        lru = self._lru.pop(pod, None)
        bit = self._bits.get(pod)
        if lru is not None and bit is not None:
            for key in lru:
                self._discard(key, bit)
        self._release(pod)

    def retain(self, pods: Collection[str]) -> None:
        """Forget every pod not in ``pods`` (the pool's current members)."""
        for pod in [pod for pod in self._bits if pod not in pods]:
            self.forget(pod)


@dataclass(slots=True)
class _PodBlocks:
    """One pod's announced blocks: engine hash -> policyd key."""

    keys: dict[EngineHash, int] = field(default_factory=dict)
    # Keys stored under more than one engine hash (e.g. a cache salt differs), beyond the first.
    extra_refs: dict[int, int] = field(default_factory=dict)
    block_size: int | None = None
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> blocks not indexed


class PreciseIndex(_Holders):
    """The blocks each pod announced in its KV-cache events, keyed as policyd keys prompts.

    A ``BlockStored`` event's keys chain from its parent block's key (the root
    seeded with the adapter's name, else the base model's, for a sequence's
    first block) over each ``block_size`` token ids. A block whose parent the
    index never saw cannot be named by a request's keys and is not indexed
    (counted in ``skipped``), nor is a block in another medium than the GPU,
    nor a block past ``max_blocks_per_pod`` while the pod holds that many.
    """

    def __init__(self, max_blocks_per_pod: int = MAX_BLOCKS_PER_POD) -> None:
        super().__init__()
        self.max_blocks_per_pod = max_blocks_per_pod
        self._pods: dict[str, _PodBlocks] = {}
        self._sizes: Counter[int] = Counter()  # announced block size -> pods announcing it

    def block_size(self, pod: str) -> int | None:
        state = self._pods.get(pod)
        return None if state is None else state.block_size

    def block_sizes(self) -> Collection[int]:
        return self._sizes.keys()

    def blocks(self, pod: str) -> int:
        """Blocks indexed for ``pod``."""
        state = self._pods.get(pod)
        return 0 if state is None else len(state.keys)

    def skipped(self, pod: str) -> dict[str, int]:
        """Blocks of ``pod``'s events not indexed, by reason."""
        state = self._pods.get(pod)
        return {} if state is None else dict(state.skipped)

    def apply(self, pod: str, events: Iterable[KvEvent]) -> None:
        """Apply ``pod``'s decoded events in order."""
        state = self._pods.get(pod)
        if state is None:
            state = self._pods[pod] = _PodBlocks()
        bit = self._bit(pod)
        for event in events:
            if isinstance(event, BlockStored):
                self._store(pod, state, bit, event)
            elif isinstance(event, BlockRemoved):
                if event.medium in (None, _GPU):
                    self._remove(state, bit, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._clear(state, bit)

    def clear(self, pod: str) -> None:
        """Forget what ``pod`` holds (its events resync from here) but keep following it."""
        state = self._pods.get(pod)
        bit = self._bits.get(pod)
        if state is not None and bit is not None:
            self._clear(state, bit)

    def forget(self, pod: str) -> None:
        self.clear(pod)
        state = self._pods.pop(pod, None)
        if state is not None:
            self._count_size(state.block_size, None)
        self._release(pod)

    def _count_size(self, old: int | None, new: int | None) -> None:
        if old is not None:
            self._sizes[old] -= 1
            if not self._sizes[old]:
                del self._sizes[old]
        if new is not None:
            self._sizes[new] += 1

    def _store(self, pod: str, state: _PodBlocks, bit: int, event: BlockStored) -> None:
        count = len(event.block_hashes)
        size = event.block_size
        if event.medium not in (None, _GPU):
            return
        if len(event.token_ids) != count * size:
            _skip(pod, state, "token ids do not fill the blocks", count)
            return
        if event.parent_block_hash is None:
            seed = event.served_as
            if seed is None:
                reason = (
                    "an adapter named only by its id"
                    if event.lora_id is not None
                    else "the base model unnamed (the topic names none)"
                )
                _skip(pod, state, reason, count)
                return
            parent = root_key(seed)
        else:
            known = state.keys.get(event.parent_block_hash)
            if known is None:
                _skip(pod, state, "parent block never announced", count)
                return
            parent = known
        if state.block_size != size:
            self._count_size(state.block_size, size)
            state.block_size = size
        keys = state.keys
        tokens = event.token_ids
        for i, engine_hash in enumerate(event.block_hashes):
            key = chain_key(parent, tokens[i * size : (i + 1) * size])
            if engine_hash not in keys:  # a replayed batch repeats what is already here
                if len(keys) >= (cap := self.max_blocks_per_pod):  # the rest chain from it
                    _skip(pod, state, f"over the cap of {cap} blocks", count - i)
                    return
                keys[engine_hash] = key
                if self._holds(key, bit):
                    state.extra_refs[key] = state.extra_refs.get(key, 0) + 1
                else:
                    self._add(key, bit)
            parent = key

    def _remove(self, state: _PodBlocks, bit: int, hashes: Iterable[EngineHash]) -> None:
        for engine_hash in hashes:
            key = state.keys.pop(engine_hash, None)
            if key is None:
                continue
            extra = state.extra_refs.get(key, 0)
            if extra > 1:
                state.extra_refs[key] = extra - 1
            elif extra:
                del state.extra_refs[key]
            else:
                self._discard(key, bit)

    def _clear(self, state: _PodBlocks, bit: int) -> None:
        for key in state.keys.values():
            self._discard(key, bit)
        state.keys.clear()
        state.extra_refs.clear()


def _skip(pod: str, state: _PodBlocks, reason: str, blocks: int) -> None:
    """Count blocks not indexed; the first of each reason per pod is logged."""
    if reason not in state.skipped:
        _log.warning("KV events of %s: %d blocks not indexed: %s", pod, blocks, reason)
        state.skipped[reason] = 0
    state.skipped[reason] += blocks
