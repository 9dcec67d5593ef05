"""Generated text: words from a fixed list, so streamed output looks like text and
costs nothing to make. (Prompts are tokenized by ``policyd.sim.tokenizer``.)
"""

from __future__ import annotations

from typing import Final

from policyd.sim.tokenizer import tokenize

_WORDS: Final = (
    *("the", "model", "answers", "with", "a", "short", "and", "plain", "text", "about"),
    *("routing", "requests", "to", "pods", "that", "already", "hold", "their", "adapter"),
    *("so", "queues", "stay", "low", "while", "every", "batch", "keeps", "the", "GPU"),
    *("busy", "."),
)


def token_text(request_seed: int, position: int) -> str:
    """The text of generated token ``position`` of a request (a space and a word)."""
    return " " + _WORDS[(request_seed + position) % len(_WORDS)]


def generated_text(request_seed: int, start: int, stop: int) -> str:
    """The text of generated tokens ``start`` up to ``stop`` (exclusive)."""
    return "".join(token_text(request_seed, i) for i in range(start, stop))


def token_id(request_seed: int, position: int) -> int:
    """The id of generated token ``position``: its text tokenized as a prompt would be,
    so a client resending the text (after the prompt it followed) sends these ids."""
    return _IDS[(request_seed + position) % len(_WORDS)]


_IDS: Final = tuple(tokenize(word)[1] for word in _WORDS)
