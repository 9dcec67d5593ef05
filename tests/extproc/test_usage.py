"""Usage read from JSON and server-sent-event responses, however Envoy chunks them."""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from policyd.extproc.usage import MAX_JSON_BODY, Usage, UsageReader


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
    reader = UsageReader(content_type)
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


def test_a_json_answer_larger_than_the_cap_is_not_kept() -> None:
    reader = UsageReader("application/json")
    reader.feed(b'{"pad": "' + b"x" * MAX_JSON_BODY)
    reader.feed(b'", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}')
    assert reader.finish() is None


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
