"""Reading OpenAI completions and chat request bodies, and rewriting the model.

This module fills the ``policy.Request`` routing sees: from the body the
model, a prompt length, the completion budget and whether the answer streams;
from the request's headers and path the rest (a new request field declared in
``policyd.fields`` is filled here). Everything else in the body is passed
through untouched. Types are checked only where policyd reads a
field, so a malformed field the router relies on is a clear 400 and an unknown
field is none of policyd's business.

The prompt length is an *estimate*: a real tokenizer per model would cost more
than the whole routing decision. Text counts as one token per four characters
(the usual rule of thumb for English BPE vocabularies), chat messages add a
few tokens each for the role and delimiters, and prompts given as token ids
are counted exactly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from policyd.extproc.errors import RequestError
from policyd.policy.request import Request

CHARS_PER_TOKEN: Final = 4
TOKENS_PER_MESSAGE: Final = 4  # role, separators and the turn delimiter of chat templates

MAX_MODEL_BYTES: Final = 1024  # the default limit on a model name (ServingSettings)

CHAT_SUFFIX: Final = "/chat/completions"
COMPLETIONS_SUFFIX: Final = "/completions"

REQUEST_ID_HEADER: Final = "x-request-id"
_NO_HEADERS: Final[Mapping[str, str]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class InferenceBody:
    """The ``Request`` routing reads; ``document`` is the body, kept for a rewrite."""

    document: dict[str, Any]
    request: Request


def estimate_text_tokens(text: str) -> int:
    """Tokens in ``text`` by the four-characters rule, rounded up."""
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def request_without_body(headers: Mapping[str, str], path: str) -> Request:
    """The ``Request`` of a body-less GET or HEAD: no model, the header and path fields."""
    return Request(model="", headers=headers, path=path, id=headers.get(REQUEST_ID_HEADER, ""))


def parse_body(
    raw: bytes,
    path: str,
    max_model_bytes: int = MAX_MODEL_BYTES,
    *,
    headers: Mapping[str, str] = _NO_HEADERS,
) -> InferenceBody:
    """Parse and check a request body into its ``Request``; raises :class:`RequestError` (400).

    ``headers`` are the request's (lower-case names); the request id is their
    ``x-request-id``. Criticality and the target model are the policy's to
    decide (its own header, the model's setting, its default), so they are
    not read here.

    A model name over ``max_model_bytes`` (UTF-8) is a 400 too: the model is
    kept for the whole request (the span, the decision log, caches keyed on
    it), and no real model name is kilobytes long.

    ``path`` picks the API: ``.../chat/completions`` requires ``messages``,
    ``.../completions`` requires ``prompt``; other paths (embeddings, a
    server's own endpoints) only need ``model``, and their prompt is
    estimated from ``prompt`` or ``messages`` when present.
    """
    if not raw:
        raise RequestError.bad_request(
            "the request body is empty; a JSON object is required", "missing_body"
        )
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise RequestError.bad_request(
            f"the request body is not valid JSON: {error}", "invalid_json"
        ) from None
    if not isinstance(document, dict):
        raise RequestError.bad_request("the request body must be a JSON object", "invalid_json")

    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError.bad_request(
            "the request body has no 'model' (a non-empty string is required)", "missing_model"
        )
    if len(model) > max_model_bytes or (
        not model.isascii() and len(model.encode("utf-8", "surrogatepass")) > max_model_bytes
    ):
        raise RequestError.bad_request(
            f"the request body's 'model' is longer than {max_model_bytes} bytes", "model_too_long"
        )

    if path.endswith(CHAT_SUFFIX):
        prompt_tokens = _messages_tokens(_required(document, "messages"))
    elif path.endswith(COMPLETIONS_SUFFIX):
        prompt_tokens = _prompt_tokens(_required(document, "prompt"))
    elif "messages" in document:
        prompt_tokens = _messages_tokens(document["messages"])
    elif "prompt" in document:
        prompt_tokens = _prompt_tokens(document["prompt"])
    else:
        prompt_tokens = 0

    request = Request(
        model=model,
        headers=headers,
        prompt_tokens=prompt_tokens,
        max_tokens=_max_tokens(document),
        stream=_optional_bool(document, "stream"),
        path=path,
        id=headers.get(REQUEST_ID_HEADER, ""),
    )
    return InferenceBody(document, request)


def rewrite_model(body: InferenceBody, model: str) -> bytes:
    """The body with ``model`` replaced, re-serialised compactly (other fields kept)."""
    document = dict(body.document)
    document["model"] = model
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


def _required(document: dict[str, Any], name: str) -> Any:
    if name not in document:
        raise RequestError.bad_request(f"the request body has no '{name}'", f"missing_{name}")
    return document[name]


def _prompt_tokens(prompt: Any) -> int:
    """A completions ``prompt``: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return estimate_text_tokens(prompt)
    if isinstance(prompt, list):
        if all(isinstance(item, str) for item in prompt):
            return sum(estimate_text_tokens(item) for item in prompt)
        if all(_is_int(item) for item in prompt):
            return len(prompt)
        if all(isinstance(item, list) and all(_is_int(t) for t in item) for item in prompt):
            return sum(len(item) for item in prompt)
    raise RequestError.bad_request(
        "'prompt' must be a string, a list of strings, a list of token ids"
        " or a list of token-id lists",
        "invalid_prompt",
    )


def _messages_tokens(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise RequestError.bad_request(
            "'messages' must be a non-empty list of message objects", "invalid_messages"
        )
    total = 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError.bad_request(
                f"'messages[{index}]' must be an object", "invalid_messages"
            )
        total += TOKENS_PER_MESSAGE + _content_tokens(message.get("content"), index)
    return total


def _content_tokens(content: Any, index: int) -> int:
    """A message's content: a string, null (tool calls), or a list of parts."""
    if content is None:
        return 0
    if isinstance(content, str):
        return estimate_text_tokens(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if not isinstance(part, dict):
                break
            text = part.get("text")
            if isinstance(text, str):
                total += estimate_text_tokens(text)
        else:
            return total
    raise RequestError.bad_request(
        f"'messages[{index}].content' must be a string, null or a list of content parts",
        "invalid_messages",
    )


def _max_tokens(document: dict[str, Any]) -> int:
    """The completion budget: ``max_completion_tokens`` (chat) or ``max_tokens``; 0 if unset."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = document.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 0:
            raise RequestError.bad_request(
                f"'{name}' must be a non-negative integer", "invalid_max_tokens"
            )
        return int(value)
    return 0


def _optional_bool(document: dict[str, Any], name: str) -> bool:
    value = document.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError.bad_request(f"'{name}' must be a boolean", f"invalid_{name}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
