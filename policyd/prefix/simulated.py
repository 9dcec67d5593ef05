"""The simulated pods' tokenizer: the contract between the simulator and prefix matching.

There is no model, so no real vocabulary: a prompt becomes a beginning-of-sequence
id, then one id per word or punctuation mark (about what Llama's tokenizer gives
for English), each id a stable hash of its text. Chat messages are rendered to
one text first (``render_chat``), as a chat template would. Equal prefixes give
equal ids, which is all prefix caching and prompt-length accounting need.

It lives here, on the router's side, because it is what the ``sim`` prefix
tokenizer computes; the simulator imports it (``policyd.sim.tokenizer``
publishes it with the block hashes) so the simulated pods compute exactly
these ids. Everything here is deterministic across processes (no ``hash()``,
no ``PYTHONHASHSEED``): changing it changes what routers see.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Mapping
from typing import Final

BOS_TOKEN: Final = 1
VOCABULARY_SIZE: Final = 32000
_FIRST_WORD_ID: Final = 3
_PIECE: Final = re.compile(r"\w+|[^\w\s]")


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
