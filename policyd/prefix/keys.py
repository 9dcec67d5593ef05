"""policyd's own chained keys of a prompt's full KV blocks.

A block is named by everything before it: its key chains the key of the block
before it with its own token ids, and the first block's parent is a seed made
from the model or adapter name the request is served as (the same tokens under
another adapter are another cache entry on the pod). Only full blocks count: a
model server never caches a partial tail block.

These are not the engine's block hashes: the precise index recomputes them from
the token ids of the pods' ``BlockStored`` events (as llm-d's KV-cache indexer
does), so it never depends on an engine's hash function, hash seed or hash
version. The keys live in one process only (both the index and the requests'
keys are computed here), which lets them use Python's tuple hash of int tuples:
deterministic across processes for integers, and about five times cheaper than
blake2b per block. The seed is a blake2b digest so that it, too, does not
depend on ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Final

_SEED_BYTES: Final = 8
_SEED_CACHE: Final = 4096  # model and adapter names a process sees; each costs ~200 bytes


@functools.lru_cache(maxsize=_SEED_CACHE)
def root_key(model: str) -> int:
    """The parent of a chain's first block: the served model's or adapter's name, hashed."""
    digest = hashlib.blake2b(model.encode(), digest_size=_SEED_BYTES, person=b"policyd-prefix")
    return int.from_bytes(digest.digest(), "big", signed=True)


def chain_key(parent: int, block: tuple[int, ...]) -> int:
    """The key of a full block of token ids that follows the block keyed ``parent``."""
    return hash((parent, block))


def block_keys(tokens: Sequence[int], block_size: int, model: str) -> tuple[int, ...]:
    """Chained 64-bit keys of the full ``block_size``-token blocks of ``tokens``.

    ``model`` is the name the request is served as: the base model's or the adapter's.
    """
    if block_size <= 0:
        raise ValueError(f"a block size must be positive, got {block_size}")
    ids = tokens if isinstance(tokens, tuple) else tuple(tokens)
    keys: list[int] = []
    parent = root_key(model)
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = chain_key(parent, ids[start : start + block_size])
        keys.append(parent)
    return tuple(keys)
