"""Usage read from JSON and server-sent-event responses, however Envoy chunks them."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policyd.extproc.budget import ByteBudget
from policyd.extproc.usage import MAX_USAGE_BYTES, Usage, UsageReader


def stream(usage: dict[str, int] | None) -> bytes:
    events = [
        {"choices": [{"text": "a"}], "usage": None},
        {"choices": [{"text": "b"}]},
    ]
    if usage is not None:
        events.append({"choices": [], "usage": usage})
    text = "".join(f"data: {json.dumps(e)}\r\n\r\n" for e in events) + "data: [DONE]\r\n\r\n"
    return text.encode()


def read(content_type: str, chunks: list[bytes]) -> Usage | None:
    reader = UsageReader(content_type, ByteBudget(1 << 20))
    for chunk in chunks:
        reader.feed(chunk)
    return reader.finish()


def test_a_json_answer_gives_its_usage() -> None:
    answer = json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}})
    raw = answer.encode()
    assert read("application/json; charset=utf-8", [raw[:10], raw[10:]]) == Usage(9, 4)


def test_a_stream_gives_the_usage_of_its_final_event() -> None:
    assert read("text/event-stream", [stream({"prompt_tokens": 3, "completion_tokens": 2})]) == (
        Usage(3, 2)
    )


def test_a_stream_without_usage_gives_none() -> None:
    assert read("text/event-stream", [stream(None)]) is None


@given(st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_any_chunking_of_a_stream_gives_the_same_usage(cuts: list[int]) -> None:
    raw = stream({"prompt_tokens": 30, "completion_tokens": 12})
    bounds = sorted({min(c, len(raw)) for c in cuts} | {0, len(raw)})
    chunks = [raw[a:b] for a, b in itertools.pairwise(bounds)]
    assert read("text/event-stream", chunks) == Usage(30, 12)


def test_a_last_event_without_a_trailing_newline_still_counts() -> None:
    raw = b'data: {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}'
    assert read("text/event-stream", [raw]) == Usage(1, 1)


def test_other_content_types_and_broken_documents_give_none() -> None:
    usage = b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}'
    assert read("text/plain", [usage]) is None
    assert read("", [usage]) is None
    assert read("application/json", [b'{"usage": {"prompt_tokens": "x"}}']) is None
    assert read("application/json", [b'{"usage": ']) is None
    assert read("text/event-stream", [b'data: {not json, "usage"}\n\n']) is None


def test_a_large_json_answer_keeps_only_what_follows_its_usage_key() -> None:
    budget = ByteBudget(1 << 20)
    reader = UsageReader("application/json", budget)
    reader.feed(b'{"pad": "' + b"x" * (8 << 20))
    assert budget.held == 0  # nothing kept before the key
    reader.feed(b'", "usage": {"prompt_tokens": 1, "completion_tokens": 1}, "prompt_logprobs": [')
    reader.feed(b"0.5," * (1 << 20) + b"0.5]}")
    assert budget.held == MAX_USAGE_BYTES  # the key on, cut at the cap
    assert reader.finish() == Usage(1, 1)
    assert budget.held == 0


@pytest.mark.parametrize("cut", range(1, 8))
def test_a_usage_key_split_between_chunks_is_found(cut: int) -> None:
    answer = b'{"a": 1, "usage": {"prompt_tokens": 4, "completion_tokens": 2}}'
    at = answer.index(b'"usage"') + cut
    assert read("application/json", [answer[:at], answer[at:]]) == Usage(4, 2)
    pieces = [answer[i : i + 1] for i in range(len(answer))]  # byte by byte
    assert read("application/json", pieces) == Usage(4, 2)


def test_a_full_budget_leaves_a_response_unread_and_holds_nothing_more() -> None:
    budget = ByteBudget(100)
    first = UsageReader("application/json", budget)
    first.feed(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}, "x": "' + b"y" * 200)
    assert budget.held == 0 and budget.refused == 1  # past the limit: not read
    assert first.finish() is None
    events = UsageReader("text/event-stream", budget)
    events.feed(b'data: {"usage": {"prompt_tokens": 2, "completion_tokens": 3}}')  # unterminated
    assert budget.held > 0
    assert events.finish() == Usage(2, 3)
    assert budget.held == 0


def test_only_the_answers_own_usage_member_counts() -> None:
    answer = {
        "choices": [{"text": 'he said "usage": {"prompt_tokens": 99} and left'}],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
    }
    pretty = json.dumps(answer, indent=2).encode()
    assert read("application/json", [pretty]) == Usage(7, 3, cached_tokens=2)
    assert read("application/json", [b'{"choices": [], "usage": null}']) is None
