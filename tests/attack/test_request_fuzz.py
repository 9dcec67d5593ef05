"""Property-based fuzzing of the request-body parser (``parse_body``).

Whatever a client sends, the parser either reads a ``Request`` whose fields
are in range and whose body can be rewritten and forwarded, or raises a 400
``RequestError``; never another exception (a 500 and a stack trace), whatever
the bytes, the JSON shape or the API path.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policyd.extproc.errors import RequestError
from policyd.extproc.openai import MAX_COMPLETION_TOKENS, parse_body, rewrite_model

PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/messages",
    "/v1/other",
)

# Any text, lone surrogates included (JSON can escape them; Python strings hold them).
TEXT = st.text(st.characters(codec=None), max_size=12)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False)
    | TEXT
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=5),
    max_leaves=25,
)
# Bodies shaped like the APIs' own, with any value where a field is read.
FIELDS = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "input",
        "instructions",
        "system",
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "stream",
        "content",
        "role",
    ]
)
MESSAGE = st.dictionaries(st.sampled_from(["role", "content", "type", "text"]), JSON, max_size=4)
SHAPED = st.fixed_dictionaries(
    {"model": st.one_of(st.just("m"), JSON)},
    optional={
        "messages": st.lists(MESSAGE, max_size=4) | JSON,
        "prompt": st.lists(st.integers(-5, 2**40), max_size=5) | JSON,
        "input": st.lists(MESSAGE | TEXT, max_size=4) | JSON,
        "max_tokens": st.integers(min_value=-(2**70), max_value=2**70) | JSON,
        "stream": JSON,
    },
) | st.dictionaries(FIELDS, JSON, max_size=6)


def _encode(document: Any) -> bytes:
    # ensure_ascii escapes a lone surrogate as \udXXX, as a client's encoder would.
    return json.dumps(document).encode()


def check(raw: bytes, path: str) -> None:
    try:
        parsed = parse_body(raw, path)
    except RequestError as error:
        assert error.status == 400
        assert error.code and error.message
        json.loads(error.json_body())
        return
    request = parsed.request
    assert isinstance(request.model, str) and request.model
    assert 0 <= request.max_tokens <= MAX_COMPLETION_TOKENS
    assert request.prompt_tokens >= 0
    assert isinstance(request.stream, bool)
    # What is forwarded can be encoded: a rewrite never fails on the body's text.
    json.loads(rewrite_model(parsed, "other-model"))


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(document=SHAPED, path=st.sampled_from(PATHS))
def test_api_shaped_bodies_are_read_or_a_400(document: dict[str, Any], path: str) -> None:
    check(_encode(document), path)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(document=JSON, path=st.sampled_from(PATHS))
def test_any_json_value_is_read_or_a_400(document: Any, path: str) -> None:
    check(_encode(document), path)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200), path=st.sampled_from(PATHS))
def test_any_bytes_are_read_or_a_400(raw: bytes, path: str) -> None:
    check(raw, path)


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.binary(max_size=40),
    middle=st.sampled_from([b"\\ud800", b"\\udfff", b"\xed\xa0\x80", b"\\u0000", b"\xff"]),
    path=st.sampled_from(PATHS),
)
def test_broken_text_inside_a_valid_body_is_read_or_a_400(
    prefix: bytes, middle: bytes, path: str
) -> None:
    check(b'{"model": "m", "prompt": "' + prefix + middle + b'", "messages": []}', path)
