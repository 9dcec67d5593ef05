"""The simulated pods' tokenizer and block hashes: a stable API a router may import.

There is no model, so no real vocabulary: a prompt becomes a beginning-of-sequence
id, then one id per word or punctuation mark (about what Llama's tokenizer gives
for English), each id a stable hash of its text. Chat messages are rendered to
one text first (``render_chat``), as a chat template would. Equal prefixes give
equal ids, which is all prefix caching and prompt-length accounting need.

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
import re
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

BOS_TOKEN: Final = 1
VOCABULARY_SIZE: Final = 32000
_FIRST_WORD_ID: Final = 3
_PIECE: Final = re.compile(r"\w+|[^\w\s]")
_HASH_BYTES: Final = 8


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``: a beginning-of-sequence id, then one id per word or mark."""
    span = VOCABULARY_SIZE - _FIRST_WORD_ID
    return [BOS_TOKEN] + [
        _FIRST_WORD_ID + zlib.crc32(piece.encode()) % span for piece in _PIECE.findall(text)
    ]


def render_chat(messages: Iterable[Mapping[str, str]], *, generation_prompt: bool = False) -> str:
    """The simulator's chat template: one ``role: content`` line per message.

    With ``generation_prompt`` a last line opens the assistant's reply
    (``assistant:``), as vLLM renders a chat request with the template's
    generation prompt: a client resending the reply inside an ``assistant``
    message then sends the tokens the pod computed, header and reply alike.
    """
    text = "\n".join(f"{message['role']}: {message['content']}" for message in messages)
    return f"{text}\nassistant:" if generation_prompt else text


def tokenize_chat(messages: Iterable[Mapping[str, str]]) -> list[int]:
    """Token ids of chat ``messages`` (text contents), as the pods count and cache them."""
    return tokenize(render_chat(messages))


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
