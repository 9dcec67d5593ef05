"""Each API's body shape: OpenAI responses and embeddings, Anthropic messages, unknown paths.

What is read for routing (model, prompt estimate, budget, stream), the prompt's
canonical text, clear 400s for wrong types, the model rewrite, and the usage
each API's answers report.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from policyd.extproc.budget import ByteBudget
from policyd.extproc.errors import RequestError
from policyd.extproc.openai import (
    TOKENS_PER_MESSAGE,
    Turn,
    api_of,
    parse_body,
    prompt_of,
    rewrite_model,
)
from policyd.extproc.usage import Usage, UsageReader

RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
MESSAGES = "/v1/messages"
M = TOKENS_PER_MESSAGE


def body(document: Any) -> bytes:
    return json.dumps(document).encode()


def fields(document: Any, path: str) -> tuple[str, int, int, bool]:
    request = parse_body(body(document), path).request
    return request.model, request.prompt_tokens, request.max_tokens, request.stream


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/chat/completions", "chat"),
        ("/v1/completions", "completions"),
        ("/openai/v1/responses", "responses"),
        ("/v1/embeddings", "embeddings"),
        ("/v1/messages", "messages"),
        ("/v1/messages/count_tokens", ""),
        ("/v1/responses/resp_1/cancel", ""),
        ("/generate", ""),
    ],
)
def test_the_path_suffix_picks_the_api(path: str, api: str) -> None:
    assert api_of(path) == api


def test_a_responses_body_reads_instructions_input_items_and_max_output_tokens() -> None:
    document = {
        "model": "gpt",
        "instructions": "i" * 8,
        "input": [
            {"role": "user", "content": "u" * 4},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "a" * 5}],
            },
            {"type": "function_call", "name": "f", "arguments": '{"x":1}'},
            {"type": "function_call_output", "call_id": "c", "output": "o" * 9},
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "q"}, {"type": "input_image"}],
            },
        ],
        "max_output_tokens": 50,
        "max_tokens": 7,  # not the responses API's: ignored
        "stream": True,
    }
    assert fields(document, RESPONSES) == ("gpt", 6 * M + 2 + 1 + 2 + 2 + 3 + 1, 50, True)
    assert prompt_of(document, "responses") == (
        Turn("system", ("iiiiiiii",)),
        Turn("user", ("uuuu",)),
        Turn("assistant", ("aaaaa",)),
        Turn("function_call", ('{"x":1}',)),
        Turn("function_call_output", ("ooooooooo",)),
        Turn("user", ("q",)),
    )


def test_a_responses_string_input_is_one_user_message() -> None:
    assert fields({"model": "gpt", "input": "abcdefgh"}, RESPONSES) == ("gpt", M + 2, 0, False)
    assert prompt_of({"input": "hi", "instructions": None}, "responses") == (Turn("user", ("hi",)),)


@pytest.mark.parametrize(
    ("value", "tokens"),
    [("abcd", 1), (["abcd", "abcde"], 3), ([1, 2, 3], 3), ([[1, 2], [3]], 3), ([], 0)],
)
def test_every_embeddings_input_shape_is_counted(value: Any, tokens: int) -> None:
    assert fields({"model": "emb", "input": value}, EMBEDDINGS) == ("emb", tokens, 0, False)


def test_embeddings_inputs_are_bare_text_or_token_ids_in_order() -> None:
    assert prompt_of({"input": ["a", "b"]}, "embeddings") == (
        Turn(None, ("a",)),
        Turn(None, ("b",)),
    )
    assert prompt_of({"input": [[1, 2], [3]]}, "embeddings") == (
        Turn(None, token_ids=(1, 2)),
        Turn(None, token_ids=(3,)),
    )


def test_an_anthropic_messages_body_reads_system_blocks_and_max_tokens() -> None:
    document = {
        "model": "claude",
        "max_tokens": 1024,
        "system": [{"type": "text", "text": "s" * 8, "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "u" * 4},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "text", "text": "r" * 4}],
                    },
                    {"type": "text", "text": "q"},
                ],
            },
        ],
        "stream": True,
    }
    assert fields(document, MESSAGES) == ("claude", 4 * M + 2 + 1 + 1 + 1, 1024, True)
    assert prompt_of(document, "messages") == (
        Turn("system", ("ssssssss",)),
        Turn("user", ("uuuu",)),
        Turn("assistant"),
        Turn("user", ("rrrr", "q")),
    )
    plain = {"model": "claude", "system": "abcd", "messages": [{"role": "user", "content": "x"}]}
    assert fields(plain, MESSAGES) == ("claude", 2 * M + 1 + 1, 0, False)


def test_the_same_conversation_reads_the_same_in_chat_and_messages() -> None:
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat = prompt_of({"messages": turns}, "chat")
    anthropic = prompt_of({"messages": turns}, "messages")
    longer = prompt_of({"messages": [*turns, {"role": "user", "content": "?"}]}, "chat")
    assert chat == anthropic == (Turn("user", ("hi",)), Turn("assistant", ("yo",)))
    assert longer[: len(chat)] == chat  # a later state of a conversation extends it


def test_an_unknown_path_is_routed_by_its_model_with_a_lenient_estimate() -> None:
    assert fields(
        {"model": "m", "messages": [{"content": "abcd"}]}, "/v1/messages/count_tokens"
    ) == (
        "m",
        M + 1,
        0,
        False,
    )
    assert fields({"model": "m", "input": "abcd", "max_tokens": 3}, "/v1/score") == (
        "m",
        0,
        3,
        False,
    )
    assert fields({"model": "m", "messages": 7, "stream": 1}, "/x") == ("m", 0, 0, False)
    with pytest.raises(RequestError) as caught:
        parse_body(body({"input": "x"}), "/v1/score")
    assert (caught.value.status, caught.value.code) == (400, "missing_model")


@pytest.mark.parametrize(
    ("document", "path", "code"),
    [
        ({"model": "m"}, RESPONSES, "missing_input"),
        ({"model": "m", "input": 5}, RESPONSES, "invalid_input"),
        ({"model": "m", "input": {"role": "user"}}, RESPONSES, "invalid_input"),
        ({"model": "m", "input": ["hi"]}, RESPONSES, "invalid_input"),
        ({"model": "m", "input": [{"role": "user", "content": 3}]}, RESPONSES, "invalid_input"),
        ({"model": "m", "input": [{"content": ["x"]}]}, RESPONSES, "invalid_input"),
        ({"model": "m", "input": "x", "instructions": ["x"]}, RESPONSES, "invalid_instructions"),
        ({"model": "m", "input": "x", "max_output_tokens": -1}, RESPONSES, "invalid_max_tokens"),
        ({"model": "m", "input": "x", "stream": "true"}, RESPONSES, "invalid_stream"),
        ({"model": 3, "input": "x"}, RESPONSES, "missing_model"),
        ({"model": "m"}, EMBEDDINGS, "missing_input"),
        ({"model": "m", "input": None}, EMBEDDINGS, "invalid_input"),
        ({"model": "m", "input": ["a", 1]}, EMBEDDINGS, "invalid_input"),
        ({"model": "m", "input": [[1], ["a"]]}, EMBEDDINGS, "invalid_input"),
        ({"model": "m", "input": {"text": "a"}}, EMBEDDINGS, "invalid_input"),
        ({"input": "a"}, EMBEDDINGS, "missing_model"),
        ({"model": "m"}, MESSAGES, "missing_messages"),
        ({"model": "m", "messages": []}, MESSAGES, "invalid_messages"),
        ({"model": "m", "messages": {"role": "user"}}, MESSAGES, "invalid_messages"),
        (
            {"model": "m", "messages": [{"role": "user", "content": 1}]},
            MESSAGES,
            "invalid_messages",
        ),
        ({"model": "m", "messages": [{"content": [["text"]]}]}, MESSAGES, "invalid_messages"),
        ({"model": "m", "system": 5, "messages": [{"content": "x"}]}, MESSAGES, "invalid_system"),
        (
            {"model": "m", "system": ["s"], "messages": [{"content": "x"}]},
            MESSAGES,
            "invalid_system",
        ),
        (
            {"model": "m", "messages": [{"content": "x"}], "max_tokens": "9"},
            MESSAGES,
            "invalid_max_tokens",
        ),
        (
            {"model": "m", "messages": [{"content": "x"}], "stream": "no"},
            MESSAGES,
            "invalid_stream",
        ),
    ],
)
def test_wrong_types_are_a_400_that_says_what_is_wrong(
    document: dict[str, Any], path: str, code: str
) -> None:
    with pytest.raises(RequestError) as caught:
        parse_body(body(document), path)
    assert (caught.value.status, caught.value.code) == (400, code)
    assert json.loads(caught.value.json_body())["error"]["code"] == code


@pytest.mark.parametrize(
    ("document", "path"),
    [
        (
            {"model": "base", "input": [{"role": "user", "content": "hé"}], "store": False},
            RESPONSES,
        ),
        ({"model": "base", "input": ["a", "b"], "encoding_format": "float"}, EMBEDDINGS),
        (
            {"model": "base", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]},
            MESSAGES,
        ),
        ({"model": "base", "anything": {"k": [1]}}, "/v1/score"),
    ],
)
def test_the_model_rewrite_is_the_same_for_every_api(document: dict[str, Any], path: str) -> None:
    rewritten = rewrite_model(parse_body(body(document), path), "base-lora")
    assert json.loads(rewritten) == {**document, "model": "base-lora"}


def usage_of(content_type: str, raw: bytes) -> Usage | None:
    reader = UsageReader(content_type, ByteBudget(1 << 20))
    for at in range(0, len(raw), 7):  # small chunks, as Envoy may send them
        reader.feed(raw[at : at + 7])
    return reader.finish()


def sse(*events: tuple[str, dict[str, Any]]) -> bytes:
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events).encode()


def test_usage_of_a_responses_answer_json_and_streamed() -> None:
    answer = {
        "id": "r",
        "object": "response",
        "output": [],
        "usage": {
            "input_tokens": 9,
            "output_tokens": 4,
            "total_tokens": 13,
            "input_tokens_details": {"cached_tokens": 2},
        },
    }
    assert usage_of("application/json", body(answer)) == Usage(9, 4, cached_tokens=2)
    stream = sse(
        ("response.created", {"type": "response.created", "response": {"id": "r", "usage": None}}),
        ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "hi"}),
        ("response.completed", {"type": "response.completed", "response": answer}),
    )
    assert usage_of("text/event-stream", stream) == Usage(9, 4, cached_tokens=2)


def test_usage_of_an_embeddings_answer_has_no_completion() -> None:
    answer = {"object": "list", "data": [], "usage": {"prompt_tokens": 8, "total_tokens": 8}}
    assert usage_of("application/json", body(answer)) == Usage(8, 0)


def test_usage_of_an_anthropic_answer_counts_cached_input_and_streamed_deltas() -> None:
    usage = {
        "input_tokens": 10,
        "cache_creation_input_tokens": 5,
        "cache_read_input_tokens": 20,
        "output_tokens": 7,
    }
    answer = {
        "id": "msg",
        "type": "message",
        "content": [{"type": "text", "text": "x"}],
        "usage": usage,
    }
    assert usage_of("application/json", body(answer)) == Usage(35, 7, cached_tokens=20)
    stream = sse(
        (
            "message_start",
            {
                "type": "message_start",
                "message": {"id": "msg", "usage": {"input_tokens": 12, "output_tokens": 1}},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "hi"},
            },
        ),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 15},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    )
    assert usage_of("text/event-stream", stream) == Usage(12, 15)
    # a delta with no start before it reports nothing it can stand behind
    assert (
        usage_of("text/event-stream", sse(("message_delta", {"usage": {"output_tokens": 3}})))
        is None
    )
