"""Reading inference request bodies, and rewriting the model.

The APIs read are OpenAI's completions, chat completions, responses and
embeddings, and Anthropic's messages, each picked by the path's suffix
(:func:`api_of`); any other path is routed by its ``model`` alone (see
:func:`parse_body`). Every one names the model in a top-level ``model``, so
the rewrite is the same for all.

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
are counted exactly. Each API's prompt shape is known in one place,
:func:`prompt_of`, which gives the prompt in order as :class:`Turn` s; the
estimate is made from them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from policyd.extproc.body_limits import MAX_PROMPT_ITEMS, decode
from policyd.extproc.errors import RequestError
from policyd.policy.request import Request

CHARS_PER_TOKEN: Final = 4
TOKENS_PER_MESSAGE: Final = 4  # role, separators and the turn delimiter of chat templates

MAX_MODEL_BYTES: Final = 1024  # the default limit on a model name (ServingSettings)
# The largest completion budget read (400 past it): 2**31 - 1, beyond every model's
# context, and what a signed 32-bit field of a model server holds. A budget is
# multiplied into flow control's footprints, which must stay finite.
MAX_COMPLETION_TOKENS: Final = 2**31 - 1

CHAT_SUFFIX: Final = "/chat/completions"
COMPLETIONS_SUFFIX: Final = "/completions"
RESPONSES_SUFFIX: Final = "/responses"
EMBEDDINGS_SUFFIX: Final = "/embeddings"
MESSAGES_SUFFIX: Final = "/messages"

# The APIs by path suffix, the more specific first ("/chat/completions" before "/completions").
APIS: Final = (
    (CHAT_SUFFIX, "chat"),
    (COMPLETIONS_SUFFIX, "completions"),
    (RESPONSES_SUFFIX, "responses"),
    (EMBEDDINGS_SUFFIX, "embeddings"),
    (MESSAGES_SUFFIX, "messages"),
)

REQUEST_ID_HEADER: Final = "x-request-id"
# The client's latency objectives, in milliseconds: llm-d's names, then their older
# aliases. A statement of need, not a claim to priority: they fill ``request.slo_*``
# and nothing else (docs/serving.md, trust model), so policyd keeps the client's.
SLO_TTFT_HEADERS: Final = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
SLO_TPOT_HEADERS: Final = ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")
MAX_SLO_MS: Final = 86_400_000.0  # a day: any objective past it is a mistake, not a need
_NO_HEADERS: Final[Mapping[str, str]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class InferenceBody:
    """The ``Request`` routing reads; ``document`` is the body, kept for a rewrite;
    ``turns`` the prompt in reading order, for prefix-cache matching."""

    document: dict[str, Any]
    request: Request
    turns: tuple[Turn, ...] = ()


@dataclass(frozen=True, slots=True)
class Turn:
    """One piece of a prompt, in order: a message (``role`` a string, ``""`` when the
    message names none) or bare input (``role`` None: a completions prompt, an
    embeddings input); its text parts, and its token ids when given as ids."""

    role: str | None
    texts: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()


def api_of(path: str) -> str:
    """The API ``path`` names by its suffix: ``chat``, ``completions``, ``responses``,
    ``embeddings`` or ``messages``; ``""`` for any other path."""
    for suffix, api in APIS:
        if path.endswith(suffix):
            return api
    return ""


def prompt_of(document: dict[str, Any], api: str) -> tuple[Turn, ...]:
    """The prompt of a body of ``api`` (see :func:`api_of`), in the order the model reads it.

    The one place that knows each API's prompt shape. Raises
    :class:`RequestError` (400) when a field it reads is missing or of the
    wrong type; an unknown ``api`` has no prompt.
    """
    if api == "chat":
        return _chat_turns(_required(document, "messages"), "messages")
    if api == "completions":
        return _input_turns(_required(document, "prompt"), "prompt")
    if api == "embeddings":
        return _input_turns(_required(document, "input"), "input")
    if api == "responses":
        instructions = document.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise RequestError.bad_request(
                "'instructions' must be a string or null", "invalid_instructions"
            )
        system = (Turn("system", (instructions,)),) if instructions else ()
        return system + _responses_turns(_required(document, "input"))
    if api == "messages":
        return _system_turns(document.get("system")) + _chat_turns(
            _required(document, "messages"), "messages"
        )
    return ()


def estimate_prompt_tokens(turns: tuple[Turn, ...]) -> int:
    """Text by the four-characters rule (each part rounded up), plus
    ``TOKENS_PER_MESSAGE`` per message; token ids exactly."""
    return sum(
        (TOKENS_PER_MESSAGE if turn.role is not None else 0)
        + sum(estimate_text_tokens(text) for text in turn.texts)
        + len(turn.token_ids)
        for turn in turns
    )


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

    ``path`` picks the API by its suffix (:func:`api_of`), which says what is
    read and checked: the prompt (:func:`prompt_of`), the completion budget
    (``max_output_tokens`` for responses, ``max_completion_tokens`` else
    ``max_tokens`` for the others) and ``stream``. Any other path is routed by
    its ``model`` alone: its prompt is estimated from ``messages`` or
    ``prompt`` when they have the chat or completions shape (else 0), its
    ``max_tokens`` and ``stream`` are read when well typed, and nothing but a
    missing or bad model is a 400 (that body's shape is its server's business).
    """
    if not raw:
        raise RequestError.bad_request(
            "the request body is empty; a JSON object is required", "missing_body"
        )
    document = decode(raw)  # bounded first: ``body_limits``
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

    api = api_of(path)
    turns: tuple[Turn, ...] = ()
    if api:
        turns = prompt_of(document, api)
        prompt_tokens = estimate_prompt_tokens(turns)
        budget = ("max_output_tokens",) if api == "responses" else _BUDGET_FIELDS
        max_tokens = _max_tokens(document, budget)
        stream = _optional_bool(document, "stream")
    else:
        prompt_tokens, max_tokens, stream = _unknown_api(document)

    request = Request(
        model=model,
        headers=headers,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        slo_ttft_ms=slo_of(headers, SLO_TTFT_HEADERS),
        slo_tpot_ms=slo_of(headers, SLO_TPOT_HEADERS),
        path=path,
        id=headers.get(REQUEST_ID_HEADER, ""),
    )
    return InferenceBody(document, request, turns)


def slo_of(headers: Mapping[str, str], names: tuple[str, ...]) -> float:
    """The objective the first of ``names`` present states, in ms (0.0: none); a value
    that is not a positive number of milliseconds up to a day is a 400."""
    for name in names:
        text = headers.get(name)
        if text is None:
            continue
        try:
            value = float(text) if len(text) <= 32 else -1.0
        except ValueError:
            value = -1.0
        if not 0.0 < value <= MAX_SLO_MS:
            raise RequestError.bad_request(
                f"header {name} must be a positive number of milliseconds up to {MAX_SLO_MS:.0f}",
                "invalid_slo",
            )
        return value
    return 0.0


def rewrite_model(body: InferenceBody, model: str) -> bytes:
    """The body with ``model`` replaced, re-serialised compactly (other fields kept)."""
    document = dict(body.document)
    document["model"] = model
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


_BUDGET_FIELDS: Final = ("max_completion_tokens", "max_tokens")


def _unknown_api(document: dict[str, Any]) -> tuple[int, int, bool]:
    """An unknown path's prompt estimate, budget and stream flag, read leniently."""
    prompt_tokens = 0
    for name, api in (("messages", "chat"), ("prompt", "completions")):
        if name in document:
            with contextlib.suppress(RequestError):
                prompt_tokens = estimate_prompt_tokens(prompt_of(document, api))
            break
    try:
        max_tokens = _max_tokens(document, _BUDGET_FIELDS)
    except RequestError:
        max_tokens = 0
    stream = document.get("stream")
    return prompt_tokens, max_tokens, stream if isinstance(stream, bool) else False


def _required(document: dict[str, Any], name: str) -> Any:
    if name not in document:
        raise RequestError.bad_request(f"the request body has no '{name}'", f"missing_{name}")
    return document[name]


def _input_turns(prompt: Any, name: str) -> tuple[Turn, ...]:
    """A completions ``prompt`` or embeddings ``input``: a string, strings, token ids,
    or lists of token ids."""
    if isinstance(prompt, str):
        return (Turn(None, (prompt,)),)
    if isinstance(prompt, list):
        if prompt and _only(prompt, int):  # token ids: counted by ``body_limits`` as values
            return (Turn(None, (), tuple(prompt)),)
        _check_items(prompt, name)
        if _only(prompt, str):
            return tuple(Turn(None, (item,)) for item in prompt)
        if _only(prompt, list) and all(_only(item, int) for item in prompt):
            return tuple(Turn(None, (), tuple(item)) for item in prompt)
    raise RequestError.bad_request(
        f"'{name}' must be a string, a list of strings, a list of token ids"
        " or a list of token-id lists",
        f"invalid_{name}",
    )


def _chat_turns(messages: Any, name: str) -> tuple[Turn, ...]:
    """Chat ``messages`` or Anthropic ``messages``: objects whose ``content`` is a
    string, null (tool calls) or a list of parts (their ``text`` read; an
    Anthropic ``tool_result`` part's own ``content`` too)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError.bad_request(
            f"'{name}' must be a non-empty list of message objects", f"invalid_{name}"
        )
    _check_items(messages, name)
    turns = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError.bad_request(
                f"'{name}[{index}]' must be an object", f"invalid_{name}"
            )
        texts = _content_texts(message.get("content"))
        if texts is None:
            raise RequestError.bad_request(
                f"'{name}[{index}].content' must be a string, null or a list of content parts",
                f"invalid_{name}",
            )
        turns.append(Turn(_role(message), texts))
    return tuple(turns)


def _content_texts(content: Any) -> tuple[str, ...] | None:
    """The text parts of a message's content; None when it has the wrong shape."""
    if content is None:
        return ()
    if isinstance(content, str):
        return (content,)
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            return None
        text = part.get("text")
        if isinstance(text, str):
            texts.append(text)
        elif part.get("type") == "tool_result":
            inner = _content_texts(part.get("content"))
            texts.extend(inner or ())
    return tuple(texts)


def _responses_turns(items: Any) -> tuple[Turn, ...]:
    """A responses ``input``: a string (one user message) or a list of items.

    A message item (``content``: a string or a list of parts, ``input_text`` and
    ``output_text`` read) is a turn of its ``role``; another item (a function
    call, its output, a reasoning item) is a turn named by its ``type``, its
    ``arguments`` or ``output`` text read when a string.
    """
    if isinstance(items, str):
        return (Turn("user", (items,)),)
    if not isinstance(items, list):
        raise RequestError.bad_request(
            "'input' must be a string or a list of input items", "invalid_input"
        )
    _check_items(items, "input")
    turns = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestError.bad_request(f"'input[{index}]' must be an object", "invalid_input")
        if "content" in item:
            texts = _content_texts(item["content"])
            if texts is None:
                raise RequestError.bad_request(
                    f"'input[{index}].content' must be a string or a list of content parts",
                    "invalid_input",
                )
            turns.append(Turn(_role(item), texts))
        else:
            kind = item.get("type")
            text = next(
                (v for v in (item.get("arguments"), item.get("output")) if isinstance(v, str)),
                None,
            )
            turns.append(
                Turn(kind if isinstance(kind, str) else "", (text,) if text is not None else ())
            )
    return tuple(turns)


def _system_turns(system: Any) -> tuple[Turn, ...]:
    """Anthropic's ``system``: absent, a string, or a list of text blocks."""
    if system is None:
        return ()
    texts = _content_texts(system)
    if texts is None:
        raise RequestError.bad_request(
            "'system' must be a string or a list of text blocks", "invalid_system"
        )
    return (Turn("system", texts),)


def _role(message: dict[str, Any]) -> str:
    role = message.get("role")
    return role if isinstance(role, str) else ""


def _max_tokens(document: dict[str, Any], names: tuple[str, ...]) -> int:
    """The completion budget: the first of ``names`` that is set; 0 if none is."""
    for name in names:
        value = document.get(name)
        if value is None:
            continue
        if not _is_int(value) or not 0 <= value <= MAX_COMPLETION_TOKENS:
            raise RequestError.bad_request(
                f"'{name}' must be an integer from 0 to {MAX_COMPLETION_TOKENS}",
                "invalid_max_tokens",
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


def _check_items(items: list[Any], name: str) -> None:
    """A prompt list past ``MAX_PROMPT_ITEMS`` is a 400 before it is walked."""
    if len(items) > MAX_PROMPT_ITEMS:
        raise RequestError.bad_request(
            f"'{name}' has more than {MAX_PROMPT_ITEMS} items", "too_many_items"
        )


def _only(items: list[Any], kind: type) -> bool:
    """Whether every item is exactly of ``kind`` (not a subclass: a bool is no
    token id). ``map(type)`` runs in C: token-id lists are long."""
    return set(map(type, items)) <= {kind}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
