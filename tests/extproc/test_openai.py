"""Reading OpenAI request bodies: what routing needs, clear 400s for the rest."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policyd.extproc.errors import RequestError
from policyd.extproc.openai import (
    TOKENS_PER_MESSAGE,
    estimate_text_tokens,
    parse_body,
    request_without_body,
    rewrite_model,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def body(document: Any) -> bytes:
    return json.dumps(document).encode()


def test_a_completions_body_gives_model_budget_stream_and_prompt_estimate() -> None:
    parsed = parse_body(
        body({"model": "llama", "prompt": "a" * 10, "max_tokens": 32, "stream": True}),
        COMPLETIONS,
        headers={"x-request-id": "r1", "x-zone": "a"},
    ).request
    assert (parsed.model, parsed.prompt_tokens, parsed.max_tokens, parsed.stream) == (
        "llama",
        3,
        32,
        True,
    )
    assert (parsed.path, parsed.id, parsed.headers["x-zone"]) == (COMPLETIONS, "r1", "a")
    assert (parsed.target_model, parsed.criticality) == ("", "standard")  # the policy's


def test_a_request_without_a_body_has_no_model_and_the_header_fields() -> None:
    request = request_without_body({"x-request-id": "r2"}, "/v1/models")
    assert (request.model, request.path, request.id, request.prompt_tokens) == (
        "",
        "/v1/models",
        "r2",
        0,
    )


def test_a_chat_body_counts_every_message_and_its_text_parts() -> None:
    messages = [
        {"role": "system", "content": "s" * 8},
        {"role": "user", "content": [{"type": "text", "text": "u" * 12}, {"type": "image_url"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    parsed = parse_body(body({"model": "m", "messages": messages}), CHAT).request
    assert parsed.prompt_tokens == 3 * TOKENS_PER_MESSAGE + 2 + 3
    assert (parsed.max_tokens, parsed.stream) == (0, False)


def test_max_completion_tokens_wins_over_the_legacy_max_tokens() -> None:
    document = {"model": "m", "messages": [{"content": "x"}], "max_completion_tokens": 7}
    parsed = parse_body(body({**document, "max_tokens": 99}), CHAT).request
    assert parsed.max_tokens == 7


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ("", 0),
        ("abcd", 1),
        ("abcde", 2),
        (["abcd", "abcdefgh"], 3),
        ([101, 102, 103], 3),
        ([[1, 2], [3, 4, 5]], 5),
        ([], 0),
    ],
)
def test_every_prompt_shape_of_the_completions_api_is_counted(prompt: Any, tokens: int) -> None:
    assert (
        parse_body(body({"model": "m", "prompt": prompt}), COMPLETIONS).request.prompt_tokens
        == tokens
    )


def test_other_paths_need_only_a_model() -> None:
    parsed = parse_body(body({"model": "m", "prompt": "abcd", "stream": True}), "/generate")
    assert (parsed.request.prompt_tokens, parsed.request.stream) == (1, True)
    lenient = {"model": "m", "prompt": 5, "max_tokens": "x", "stream": "yes"}
    parsed = parse_body(body(lenient), "/generate")  # not a 400: the shape is the server's
    assert (parsed.request.prompt_tokens, parsed.request.max_tokens) == (0, 0)
    assert parsed.request.stream is False


@pytest.mark.parametrize(
    ("raw", "path", "code"),
    [
        (b"", COMPLETIONS, "missing_body"),
        (b"{", COMPLETIONS, "invalid_json"),
        (b"\xff\xfe", COMPLETIONS, "invalid_json"),
        ('{"model": "m", "prompt": "p"}'.encode("utf-16"), COMPLETIONS, "invalid_json"),
        (b"[" * 20_000, COMPLETIONS, "invalid_json"),  # deeper than the decoder goes
        (b"[" * 100_000, COMPLETIONS, "body_too_complex"),
        (b'"a string"', COMPLETIONS, "invalid_json"),
        (body({"prompt": "p"}), COMPLETIONS, "missing_model"),
        (body({"model": "", "prompt": "p"}), COMPLETIONS, "missing_model"),
        (body({"model": 7, "prompt": "p"}), COMPLETIONS, "missing_model"),
        (body({"model": "m"}), COMPLETIONS, "missing_prompt"),
        (body({"model": "m"}), CHAT, "missing_messages"),
        (body({"model": "m", "prompt": 5}), COMPLETIONS, "invalid_prompt"),
        (body({"model": "m", "prompt": ["a", 1]}), COMPLETIONS, "invalid_prompt"),
        (body({"model": "m", "messages": []}), CHAT, "invalid_messages"),
        (body({"model": "m", "messages": "hi"}), CHAT, "invalid_messages"),
        (body({"model": "m", "messages": ["hi"]}), CHAT, "invalid_messages"),
        (body({"model": "m", "messages": [{"content": 3}]}), CHAT, "invalid_messages"),
        (body({"model": "m", "messages": [{"content": ["x"]}]}), CHAT, "invalid_messages"),
        (body({"model": "m", "prompt": "p", "max_tokens": -1}), COMPLETIONS, "invalid_max_tokens"),
        (body({"model": "m", "prompt": "p", "max_tokens": 1.5}), COMPLETIONS, "invalid_max_tokens"),
        (
            body({"model": "m", "prompt": "p", "max_tokens": True}),
            COMPLETIONS,
            "invalid_max_tokens",
        ),
        (body({"model": "m", "prompt": "p", "stream": "yes"}), COMPLETIONS, "invalid_stream"),
    ],
)
def test_bad_bodies_are_a_400_that_says_what_is_wrong(raw: bytes, path: str, code: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_body(raw, path)
    assert caught.value.status == 400
    assert caught.value.code == code
    assert caught.value.message


def test_a_rewrite_changes_only_the_model() -> None:
    document = {"model": "base", "prompt": "héllo ✓", "max_tokens": 3, "extra": {"k": [1]}}
    parsed = parse_body(json.dumps(document).encode(), COMPLETIONS)
    rewritten = rewrite_model(parsed, "base-lora")
    assert json.loads(rewritten) == {**document, "model": "base-lora"}
    assert parsed.document["model"] == "base"  # the parsed body is not mutated
    assert "✓".encode() in rewritten  # text stays UTF-8, not \\u escapes


@given(st.text(max_size=200))
def test_the_estimate_is_a_quarter_of_the_characters_rounded_up(text: str) -> None:
    tokens = estimate_text_tokens(text)
    assert tokens * 4 >= len(text) > (tokens - 1) * 4 or tokens == len(text) == 0


def test_a_body_with_a_byte_order_mark_is_read() -> None:
    parsed = parse_body(b"\xef\xbb\xbf" + body({"model": "m", "prompt": "p"}), COMPLETIONS)
    assert parsed.request.model == "m"
