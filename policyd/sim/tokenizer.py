"""The simulated pods' tokenizer and block hashes: a stable API a router may import.

The tokenizer (``tokenize``, ``render_chat``, ``tokenize_chat``, ``BOS_TOKEN``)
is the prefix-matching contract of ``policyd.prefix.simulated``, published here
for the simulator's modules and its users; the router's ``sim`` tokenizer
computes the same ids from that module.

``block_hashes`` cuts token ids into the full blocks the pods' prefix cache and
KV events use (vLLM's boundaries: ``block_size`` tokens, a partial tail block is
never cached) and chains a 64-bit hash through them, seeded with the model or
adapter name. The hashes are the ``block_hashes`` of the pods' ``BlockStored``
events, so a router that tokenizes and hashes a prompt with these functions
names the same blocks the pods announce. Everything here is deterministic across
processes (no ``hash()``, no ``PYTHONHASHSEED``) and part of the simulator's
interface: changing it changes what routers see.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Final

from policyd.prefix.simulated import (
    BOS_TOKEN,
    VOCABULARY_SIZE,
    render_chat,
    tokenize,
    tokenize_chat,
)

__all__ = [
    "BOS_TOKEN",
    "VOCABULARY_SIZE",
    "block_hashes",
    "chain_hash",
    "render_chat",
    "root_hash",
    "tokenize",
    "tokenize_chat",
]

_HASH_BYTES: Final = 8


def root_hash(model: str) -> int:
    """The seed of a block-hash chain: the served model's or adapter's name, hashed."""
    digest = hashlib.blake2b(model.encode(), digest_size=_HASH_BYTES, person=b"policyd-sim")
    return int.from_bytes(digest.digest(), "big")


def chain_hash(parent: int, block: Sequence[int]) -> int:
    """The 64-bit hash of a full block of token ids following a block hashed ``parent``."""
    data = struct.pack(f">Q{len(block)}I", parent, *block)
    return int.from_bytes(hashlib.blake2b(data, digest_size=_HASH_BYTES).digest(), "big")


def block_hashes(tokens: Sequence[int], block_size: int, model: str) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of ``tokens`` served as ``model``.

    ``model`` is the name a request asks for: the base model's or the adapter's.
    """
    hashes: list[int] = []
    parent = root_hash(model)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes
