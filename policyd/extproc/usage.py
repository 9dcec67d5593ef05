"""Token usage read from a model server's response, JSON or server-sent events.

OpenAI-style servers report ``usage`` (``prompt_tokens``, ``completion_tokens``)
at the end of a JSON answer, or in the last ``data:`` event of a stream when
the client asked for ``stream_options.include_usage``. The reader sees the
response body chunk by chunk as Envoy streams it and keeps as little as it
can: a stream is scanned event by event and only events that mention
``"usage"`` are parsed; of a JSON body only what follows its last
``"usage"`` key is kept (up to ``MAX_USAGE_BYTES``), and only that member is
decoded at the end. Bodies of other types are ignored. What readers keep
counts against the server's ``ByteBudget`` (``ServingSettings.max_usage_bytes``):
a response that would take it past its limit is not read for usage, so a
flood of large answers (logprobs, embeddings) costs no more than the budget.

Other APIs name the counts differently, and all are read:

- OpenAI embeddings: ``usage.prompt_tokens`` alone (no completion: 0);
- OpenAI responses: ``usage.input_tokens``/``output_tokens``, at the top of a
  JSON answer, or in a stream under ``response`` (the ``response.completed``
  event; earlier events carry ``"usage": null``);
- Anthropic messages: ``usage.input_tokens``/``output_tokens`` (the prompt is
  ``input_tokens`` plus ``cache_creation_input_tokens`` and
  ``cache_read_input_tokens``, which Anthropic counts apart); in a stream,
  ``message_start`` carries ``message.usage`` with the input and
  ``message_delta`` a cumulative ``usage.output_tokens``, so a report without
  input counts keeps the prompt of the one before it.

Cached prompt tokens, where the server reports them: OpenAI's
``prompt_tokens_details.cached_tokens`` (vLLM with
``--enable-prompt-tokens-details``), the responses API's
``input_tokens_details.cached_tokens``, Anthropic's
``cache_read_input_tokens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from policyd.extproc.budget import ByteBudget

# What is kept of a JSON answer from its last ``"usage"`` key on: the member
# itself is a few hundred bytes; what follows it (vLLM's ``prompt_logprobs``)
# is not needed.
MAX_USAGE_BYTES: Final = 64 * 1024
MAX_SSE_LINE: Final = 1024 * 1024  # an unterminated event line larger than this is dropped
_KEY: Final = b'"usage"'
_DECODER: Final = json.JSONDecoder()  # raw_decode: the ``usage`` member alone


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens the server served from its prefix cache, where it says
    # (None: it does not): how a user sees whether prefix routing paid.
    cached_tokens: int | None = None


class UsageReader:
    """Feeds on response body chunks; ``usage`` is the last usage object seen."""

    __slots__ = ("_budget", "_carry", "_json", "_kept", "_kind", "_pending", "usage")

    def __init__(self, content_type: str, budget: ByteBudget) -> None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        self._kind = (
            "sse"
            if media_type == "text/event-stream"
            else "json"
            if media_type == "application/json"
            else ""
        )
        self._pending = bytearray()
        self._json = bytearray()  # from the last ``"usage"`` key on
        self._carry = b""  # the last bytes before this chunk: a key split between chunks
        self._budget = budget
        self._kept = 0  # bytes taken from the budget
        self.usage: Usage | None = None

    def feed(self, chunk: bytes) -> None:
        if self._kind == "sse":
            self._feed_events(chunk)
            self._keep(len(self._pending))
        elif self._kind == "json":
            self._feed_json(chunk)
            self._keep(len(self._json))

    def finish(self) -> Usage | None:
        """Call at the end: parses a JSON body's usage, flushes a last unterminated
        event, and gives the kept bytes back (later calls give the same usage)."""
        if self._kind == "json":
            usage = _usage_member(self._json)
            if usage is not None:
                self.usage = usage
        elif self._kind == "sse" and self._pending:
            self._scan_lines(bytes(self._pending))
        self._json = bytearray()
        self._pending = bytearray()
        self._keep(0)
        return self.usage

    def _keep(self, size: int) -> None:
        """Hold ``size`` bytes in all against the budget; past it, stop reading."""
        more = size - self._kept
        if more <= 0:
            self._budget.give(-more)
        elif not self._budget.take(more):
            self._kind = ""  # the server keeps as much as it may: no usage for this one
            self._json = bytearray()
            self._pending = bytearray()
            self._budget.give(self._kept)
            self._kept = 0
            return
        self._kept = size

    def _feed_json(self, chunk: bytes) -> None:
        """Keep what follows the last ``"usage"`` key so far (found in this chunk, or
        across the seam with the last one), up to ``MAX_USAGE_BYTES``."""
        carry = self._carry
        at = chunk.rfind(_KEY)
        if at >= 0:
            self._json = bytearray(chunk[at : at + MAX_USAGE_BYTES])
        elif (split := (carry + chunk[: len(_KEY) - 1]).find(_KEY)) >= 0:
            head = carry[split:]
            self._json = bytearray(head + chunk[: MAX_USAGE_BYTES - len(head)])
        elif 0 < len(self._json) < MAX_USAGE_BYTES:
            self._json += chunk[: MAX_USAGE_BYTES - len(self._json)]
        self._carry = (carry + chunk[-(len(_KEY) - 1) :])[-(len(_KEY) - 1) :]

    def _feed_events(self, chunk: bytes) -> None:
        self._pending += chunk
        end = self._pending.rfind(b"\n")
        if end < 0:
            if len(self._pending) > MAX_SSE_LINE:
                self._pending = bytearray()
            return
        complete = bytes(self._pending[: end + 1])
        del self._pending[: end + 1]
        if b'"usage"' in complete:
            self._scan_lines(complete)

    def _scan_lines(self, text: bytes) -> None:
        for line in text.splitlines():
            if line.startswith(b"data:") and b'"usage"' in line:
                self._take(line[5:])

    def _take(self, payload: bytes) -> None:
        try:
            document = json.loads(payload)
        except (ValueError, RecursionError):
            return
        usage = _usage_of(document, self.usage)
        if usage is not None:
            self.usage = usage


def _usage_member(body: bytearray) -> Usage | None:
    """The ``"usage"`` member of a JSON answer, decoding only that member.

    Servers put ``usage`` last, so the last ``"usage"`` key is the answer's; the
    key cannot occur inside a JSON string, where quotes are escaped. Generated
    text can be long, and this keeps the cost independent of it. ``body``
    starts at that key (``UsageReader``), or holds the whole answer.
    """
    at = body.rfind(b'"usage"')
    if at < 0:
        return None
    tail = body[at + len(b'"usage"') :].decode("utf-8", "replace")
    colon = tail.find(":")
    if colon < 0 or tail[:colon].strip():
        return None
    start = colon + 1
    while start < len(tail) and tail[start] in " \t\r\n":
        start += 1
    try:
        value = _DECODER.raw_decode(tail, start)[0]
    except (ValueError, RecursionError):
        return None
    return _usage_in(value)


def _usage_of(document: Any, previous: Usage | None) -> Usage | None:
    """The usage an event's document reports, if it reports one: its own ``usage``,
    or that of the ``response`` (OpenAI responses) or ``message`` (Anthropic) it
    carries."""
    if not isinstance(document, dict):
        return None
    usage = document.get("usage")
    if usage is None:
        for name in ("response", "message"):
            inner = document.get(name)
            if isinstance(inner, dict) and inner.get("usage") is not None:
                usage = inner["usage"]
                break
    return _usage_in(usage, previous)


_ANTHROPIC_CACHED: Final = ("cache_creation_input_tokens", "cache_read_input_tokens")


def _usage_in(usage: Any, previous: Usage | None = None) -> Usage | None:
    """A ``usage`` member's token counts, when it is well formed.

    ``prompt_tokens``/``completion_tokens`` (OpenAI completions, chat,
    embeddings) or ``input_tokens``/``output_tokens`` (OpenAI responses,
    Anthropic). A report with output counts but no input counts (Anthropic's
    ``message_delta``) keeps ``previous``'s prompt.
    """
    if not isinstance(usage, dict):
        return None
    cached: Any = None
    if "prompt_tokens" in usage:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
        cached = _cached_in(usage.get("prompt_tokens_details"))
    elif "input_tokens" in usage:
        prompt, completion = usage.get("input_tokens"), usage.get("output_tokens", 0)
        cached = _cached_in(usage.get("input_tokens_details"))
        for name in _ANTHROPIC_CACHED:
            count = usage.get(name)
            if isinstance(prompt, int) and isinstance(count, int):
                prompt += count
        if cached is None and _is_count(usage.get("cache_read_input_tokens")):
            cached = usage["cache_read_input_tokens"]
    elif "output_tokens" in usage and previous is not None:
        prompt, completion = previous.prompt_tokens, usage.get("output_tokens")
        cached = previous.cached_tokens
    else:
        return None
    if not isinstance(prompt, int) or not _is_count(prompt) or not _is_count(completion):
        return None
    return Usage(prompt, int(completion), cached if _is_count(cached) else None)


def _cached_in(details: Any) -> Any:
    """``cached_tokens`` of a ``*_tokens_details`` member (None when absent)."""
    return details.get("cached_tokens") if isinstance(details, dict) else None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
