"""Stand-in tokenizer and generated text.

There is no model, so no real vocabulary: a prompt becomes one token per word
or punctuation mark (about what Llama's tokenizer gives for English), each id
a stable hash of its text. Equal prefixes give equal ids, which is all prefix
caching and prompt-length accounting need. Generated tokens are words from a
fixed list, so streamed output looks like text and costs nothing to make.
"""

from __future__ import annotations

import re
import zlib
from typing import Final

BOS_TOKEN: Final = 1
_VOCABULARY_SIZE: Final = 32000
_FIRST_WORD_ID: Final = 3
_PIECE: Final = re.compile(r"\w+|[^\w\s]")
_WORDS: Final = (
    *("the", "model", "answers", "with", "a", "short", "and", "plain", "text", "about"),
    *("routing", "requests", "to", "pods", "that", "already", "hold", "their", "adapter"),
    *("so", "queues", "stay", "low", "while", "every", "batch", "keeps", "the", "GPU"),
    *("busy", "."),
)


def tokenize(text: str) -> tuple[int, ...]:
    """Token ids of ``text``: a beginning-of-sequence id, then one id per word or mark."""
    span = _VOCABULARY_SIZE - _FIRST_WORD_ID
    ids = (_FIRST_WORD_ID + zlib.crc32(piece.encode()) % span for piece in _PIECE.findall(text))
    return (BOS_TOKEN, *ids)


def token_text(request_seed: int, position: int) -> str:
    """The text of generated token ``position`` of a request (a space and a word)."""
    return " " + _WORDS[(request_seed + position) % len(_WORDS)]


def generated_text(request_seed: int, start: int, stop: int) -> str:
    """The text of generated tokens ``start`` up to ``stop`` (exclusive)."""
    return "".join(token_text(request_seed, i) for i in range(start, stop))
