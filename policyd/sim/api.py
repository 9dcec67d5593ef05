"""The OpenAI wire format the simulated pods speak: parsing requests, shaping replies.

Field names and shapes follow what vLLM's OpenAI server sends: completion and
chat objects with ``usage``; streamed chunks as server-sent events, with a
``usage: null`` on every chunk and a last chunk with empty ``choices`` carrying
the totals when ``stream_options.include_usage`` is set, then ``data: [DONE]``.
Errors use OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from policyd.sim.engine import RemotePrefill
from policyd.sim.tokenizer import render_chat, tokenize

DEFAULT_COMPLETION_MAX_TOKENS: Final = 16  # OpenAI's default for /v1/completions
# The simulator's own request field: the length of the text the request would write
# (``max_tokens`` still caps it), in place of the pod's draw. A benchmark that replays
# the requests of a virtual run sends the lengths that run drew, so both serve the same
# requests; vLLM has no such field, and routers pass it through unread.
OUTPUT_TOKENS_FIELD: Final = "sim_output_tokens"
_ERROR_TYPES: Final = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """A request the server answers with an OpenAI-style error."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(status, "APIError")
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


@dataclass(frozen=True, slots=True)
class CompletionCall:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` request."""

    chat: bool
    model: str
    prompt: tuple[int, ...]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    output_tokens: int | None = None  # OUTPUT_TOKENS_FIELD, when the client set it
    # vLLM's kv_transfer_params (NixlConnector): None when the body has none.
    kv_transfer: KvTransfer | None = None


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """What a request's ``kv_transfer_params`` ask: prefill only, for a decode pod
    (``do_remote_decode``), or decode what a prefill pod computed (``remote_prefill``)."""

    remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None


def parse_call(body: bytes, *, chat: bool, generation_prompt: bool = False) -> CompletionCall:
    """Decode and validate a request body; ``ApiError(400)`` says what is wrong.

    ``generation_prompt`` renders chat messages with the assistant's opening line.
    """
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "`model` is required and must be a non-empty string", "model")
    prompt = _chat_prompt(payload, generation_prompt) if chat else _completion_prompt(payload)
    max_tokens = _max_tokens(payload, chat=chat)
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "`stream` must be a boolean", "stream")
    options = payload.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.")
        if not isinstance(options, dict) or not isinstance(
            options.get("include_usage", False), bool
        ):
            raise ApiError(400, "`stream_options.include_usage` must be a boolean")
        include_usage = bool(options.get("include_usage", False))
    n = payload.get("n", 1)
    if n != 1:
        raise ApiError(400, "the simulator generates one choice per request (`n` must be 1)", "n")
    output_tokens = payload.get(OUTPUT_TOKENS_FIELD)
    if output_tokens is not None and (
        not isinstance(output_tokens, int) or isinstance(output_tokens, bool) or output_tokens < 1
    ):
        raise ApiError(
            400, f"`{OUTPUT_TOKENS_FIELD}` must be a positive integer", OUTPUT_TOKENS_FIELD
        )
    return CompletionCall(
        chat,
        model,
        prompt,
        max_tokens,
        stream,
        include_usage,
        output_tokens,
        parse_kv_transfer(payload.get(KV_TRANSFER_FIELD)),
    )


KV_TRANSFER_FIELD: Final = "kv_transfer_params"


def parse_kv_transfer(params: object) -> KvTransfer | None:
    """``kv_transfer_params`` as vLLM's NixlConnector reads them; ``ApiError(400)`` if malformed.

    A prefill request (``do_remote_decode: true``) carries nulls for the remote
    fields; a decode request (``do_remote_prefill: true``) carries what the
    prefill pod answered: ``remote_engine_id``, ``remote_block_ids``,
    ``remote_host``, ``remote_port`` (other keys, such as ``tp_size``, are ignored).
    """
    if params is None:
        return None
    field = KV_TRANSFER_FIELD
    if not isinstance(params, dict):
        raise ApiError(400, f"`{field}` must be an object or null", field)
    decode, prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    if not isinstance(decode or False, bool) or not isinstance(prefill or False, bool):
        raise ApiError(400, f"`{field}.do_remote_decode/do_remote_prefill` must be booleans", field)
    if decode and prefill:
        raise ApiError(400, f"`{field}` cannot ask for a remote prefill and decode at once", field)
    if decode:
        return KvTransfer(remote_decode=True)
    if not prefill:
        return KvTransfer()
    engine, blocks = params.get("remote_engine_id"), params.get("remote_block_ids")
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(engine, str) or not engine:
        raise ApiError(400, f"`{field}.remote_engine_id` must name the prefill engine", field)
    if not isinstance(blocks, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks
    ):
        raise ApiError(400, f"`{field}.remote_block_ids` must be a list of block ids", field)
    if host is not None and not isinstance(host, str):
        raise ApiError(400, f"`{field}.remote_host` must be a string or null", field)
    if port is not None and (not isinstance(port, int) or isinstance(port, bool)):
        raise ApiError(400, f"`{field}.remote_port` must be an integer or null", field)
    return KvTransfer(remote_prefill=RemotePrefill(engine, tuple(blocks), host, port))


def _completion_prompt(payload: dict[str, Any]) -> tuple[int, ...]:
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tuple(tokenize(prompt))
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return tuple(prompt)
    raise ApiError(
        400, "`prompt` must be a string, a list of one string, or a list of token ids", "prompt"
    )


def _chat_prompt(payload: dict[str, Any], generation_prompt: bool) -> tuple[int, ...]:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list", "messages")
    texts = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "every message needs a `role` string", "messages")
        texts.append({"role": message["role"], "content": _message_text(message.get("content"))})
    return tuple(tokenize(render_chat(texts, generation_prompt=generation_prompt)))


def _message_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if all(isinstance(p, str) for p in parts):
            return " ".join(str(p) for p in parts)
    raise ApiError(400, "message `content` must be a string or a list of text parts", "messages")


def _max_tokens(payload: dict[str, Any], *, chat: bool) -> int | None:
    """The requested cap, or ``None`` for chat without one (up to the context length)."""
    name = "max_tokens"
    value = payload.get(name)
    if value is None and chat:
        name, value = "max_completion_tokens", payload.get("max_completion_tokens")
    if value is None:
        return None if chat else DEFAULT_COMPLETION_MAX_TOKENS
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ApiError(400, f"`{name}` must be a positive integer", name)
    return value


def encode(payload: dict[str, Any]) -> bytes:
    """Compact JSON, as vLLM's pydantic models serialise."""
    return json.dumps(payload, separators=(",", ":")).encode()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """vLLM's usage object as ``--enable-prompt-tokens-details`` shapes it: the prompt
    tokens served from the prefix cache under ``prompt_tokens_details``."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True, slots=True)
class Reply:
    """Shapes the objects of one reply (the same id, creation time and model in each)."""

    call: CompletionCall
    reply_id: str
    created: int

    def full(
        self,
        text: str,
        finish_reason: str,
        completion_tokens: int,
        cached_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming response object (with ``kv_transfer_params`` when the
        request carried some, as vLLM answers them: null unless it prefilled for a
        remote decode)."""
        choice: dict[str, Any]
        if self.call.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=None)
        reply = {
            **self._head(chunk=False),
            "choices": [choice],
            "usage": usage(len(self.call.prompt), completion_tokens, cached_tokens),
        }
        if self.call.kv_transfer is not None:
            reply[KV_TRANSFER_FIELD] = kv_transfer_params
        return reply

    def role_chunk(self) -> dict[str, Any]:
        """The first chunk of a chat stream: the assistant role, no content yet."""
        return self._chunk({"role": "assistant", "content": ""}, None)

    def token_chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.call.chat:
            return self._chunk({"content": text}, finish_reason)
        return self._chunk(text, finish_reason)

    def usage_chunk(self, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        """The last chunk when ``include_usage`` is set: no choices, the totals."""
        return {
            **self._head(chunk=True),
            "choices": [],
            "usage": usage(len(self.call.prompt), completion_tokens, cached_tokens),
        }

    def _chunk(self, content: str | dict[str, str], finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if isinstance(content, dict):
            choice["delta"] = content
        else:
            choice["text"] = content
        choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=None)
        chunk: dict[str, Any] = {**self._head(chunk=True), "choices": [choice]}
        if self.call.include_usage:
            chunk["usage"] = None
        return chunk

    def _head(self, *, chunk: bool) -> dict[str, Any]:
        if self.call.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {
            "id": self.reply_id,
            "object": kind,
            "created": self.created,
            "model": self.call.model,
        }
