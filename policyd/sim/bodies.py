"""What the benchmarks' clients send for a workload's request: its path and JSON body.

One definition for both sides of a comparison. The live clients
(``benchmarks/live_stack.py``) post these bodies through Envoy to ``policyd
serve``; the virtual runners (``benchmarks/quality.py``, ``flow_quality.py``)
hand the same bodies to the serving path's own parser, so a policy reads the
same request in virtual time as live: the same prompt estimate, budget,
stream flag and prompt turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from policyd.sim.api import OUTPUT_TOKENS_FIELD
from policyd.sim.open_loop import Turn

COMPLETIONS_PATH: Final = "/v1/completions"
CHAT_PATH: Final = "/v1/chat/completions"


def completion_body(
    model: str, prompt: str | list[int], max_tokens: int, output_tokens: int | None = None
) -> dict[str, Any]:
    """A completions request: the seed experiment's shape (one prompt text, a budget); with
    ``output_tokens``, the length a simulated pod writes (``api.OUTPUT_TOKENS_FIELD``)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    if output_tokens is not None:
        body[OUTPUT_TOKENS_FIELD] = output_tokens
    return body


def chat_body(model: str, turns: Sequence[Turn], max_tokens: int) -> dict[str, Any]:
    """A chat request: the turns as messages (a turn without a role is the user's)."""
    return {
        "model": model,
        "messages": [
            {"role": turn.role or "user", "content": " ".join(turn.texts)} for turn in turns
        ],
        "max_tokens": max_tokens,
    }


def open_request(model: str, turns: Sequence[Turn], max_tokens: int) -> tuple[str, dict[str, Any]]:
    """The path and body of an open-loop request: chat when its turns are messages
    (every workload's), else a completions prompt of its text or token ids."""
    if any(turn.role is not None for turn in turns):
        return CHAT_PATH, chat_body(model, turns, max_tokens)
    ids = [token for turn in turns for token in turn.token_ids]
    prompt: str | list[int] = ids or " ".join(text for turn in turns for text in turn.texts)
    return COMPLETIONS_PATH, completion_body(model, prompt, max_tokens)


def streamed(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` asking for a stream whose last chunk carries the usage (output tokens)."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}
