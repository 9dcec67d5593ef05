"""Attacks on policyd's request path through its real gRPC server, each with its bound.

A client (through Envoy) can send headers and never a body, a body built to
cost the most per byte to parse, an absurd ``max_tokens`` or a lone
surrogate; a model server can answer with large bodies at once. Each test
here makes the attack and asserts what bounds it: the bytes the server's
budgets hold (their own counters), the memory a parse allocates, the answer
the attacker gets (a 400 with a JSON message), and that other requests are
served meanwhile and nothing is lost.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "extproc"))
from extproc_support import (  # beside the extproc tests
    EnvoySide,
    Mode,
    PickFirst,
    RecordingTelemetry,
    Snapshot,
    error_of,
    request_body,
    request_headers,
    response_body,
    response_headers,
    settled,
)

from policyd.extproc.body_limits import (
    MAX_JSON_CONTAINERS,
    MAX_JSON_VALUES,
    MAX_PROMPT_ITEMS,
)
from policyd.extproc.errors import RequestError
from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.extproc.openai import MAX_COMPLETION_TOKENS, parse_body
from policyd.extproc.serving import ServingSettings
from policyd.extproc.usage import MAX_USAGE_BYTES
from policyd.pool.pod import Pod

PODS = (Pod("pod-a", "10.0.0.1:8000"), Pod("pod-b", "10.0.0.2:8000"))
MIB = 1024 * 1024


class RequestRig:
    """policyd's gRPC server with a first-pod router, and a client playing Envoy."""

    def __init__(self, settings: ServingSettings) -> None:
        for pod in PODS:
            pod.load.count = 0
        self.telemetry = RecordingTelemetry()
        self.router = PickFirst()
        self.server = ExtProcServer(
            lambda: self.router,
            lambda: Snapshot(PODS),
            telemetry=self.telemetry,
            options=ServerOptions(port=0, settings=settings),
        )
        self.envoy: EnvoySide

    async def start(self) -> RequestRig:
        await self.server.start()
        self.envoy = EnvoySide(self.server.port)
        return self

    async def stop(self) -> None:
        await self.envoy.close()
        await self.server.stop(0)

    @property
    def processor(self) -> Any:
        return self.server.processor


@pytest.fixture
async def request_rig() -> AsyncIterator[RequestRig]:
    rig = await RequestRig(ServingSettings()).start()
    yield rig
    await rig.stop()


def completions(size: int) -> bytes:
    """A completions body of exactly ``size`` bytes."""
    head = b'{"model": "m", "prompt": ""}'
    return head[:-2] + b"x" * (size - len(head)) + b'"}'


def routed(reply: pb.ProcessingResponse) -> bool:
    return bool(reply.WhichOneof("response") == "request_body")


async def headers_only(rig: RequestRig, length: int) -> Any:
    """A stream that sends its headers, declaring ``length`` bytes of body, and stops."""
    call = rig.envoy.open()
    await call.write(request_headers({"content-length": str(length)}))
    assert (await call.read()).WhichOneof("response") == "request_headers"
    return call


# -- 1. the body budget and header-only streams ------------------------------------


@pytest.fixture
async def small_budget_rig() -> AsyncIterator[RequestRig]:
    """Four of the largest bodies fill the budget, as 4 x 16 MiB fill the default 64 MiB."""
    rig = await RequestRig(
        ServingSettings(max_body_bytes=250, max_buffered_body_bytes=1000, body_wait_seconds=0.05)
    ).start()
    yield rig
    await rig.stop()


async def test_header_only_streams_cannot_make_the_next_request_a_429(
    small_budget_rig: RequestRig,
) -> None:
    """Four streams declare the largest body each (the whole budget in all) and send
    none: reservations take at most half the budget, so a normal request is routed,
    and the stalled bodies, when they come, are routed too."""
    request_rig = small_budget_rig
    budget = request_rig.processor.body_budget
    stalled = [await headers_only(request_rig, 250) for _ in range(4)]

    _, reply = await request_rig.envoy.exchange(
        request_headers({"content-length": "100"}), request_body(completions(100))
    )
    assert routed(reply)  # before: a 429, until the stalled streams went
    assert budget.reserved <= budget.limit // 2
    assert budget.held <= budget.limit // 2

    for call in stalled:  # nothing lost: each late body is routed
        await call.write(request_body(completions(250)))
        assert routed(await call.read())
        await call.done_writing()
    assert budget.held == 0 and budget.reserved == 0


async def test_a_stalled_reservation_lapses_for_a_body_that_is_in_hand() -> None:
    """Reservations and a body being gathered fill the budget; once the reservations
    are older than ``body_wait_seconds`` a body that arrives takes their bytes, and
    the stalled body that comes later still fits and is routed."""
    settings = ServingSettings(
        max_body_bytes=400, max_buffered_body_bytes=1000, body_wait_seconds=0.05
    )
    request_rig = await RequestRig(settings).start()
    try:
        await _lapse_and_recover(request_rig)
    finally:
        await request_rig.stop()


async def _lapse_and_recover(request_rig: RequestRig) -> None:
    budget = request_rig.processor.body_budget
    first, second = await headers_only(request_rig, 250), await headers_only(request_rig, 250)
    gathering = request_rig.envoy.open()
    await gathering.write(request_headers(body_mode=Mode.STREAMED))
    await gathering.read()
    await gathering.write(
        request_body(b'{"model": "m", "prompt": "' + b"x" * 350, end_of_stream=False)
    )
    await gathering.read()
    assert budget.held > 1000 - 150

    await asyncio.sleep(0.1)  # past body_wait_seconds: the reservations have stalled
    _, reply = await request_rig.envoy.exchange(
        request_headers(body_mode=Mode.STREAMED), request_body(completions(150))
    )
    assert routed(reply)
    assert budget.lapsed >= 1
    assert budget.held <= budget.limit

    for call in (first, second):
        await call.write(request_body(completions(250)))
        assert routed(await call.read())
        await call.done_writing()
    await gathering.write(request_body(b'"}', end_of_stream=True))
    assert routed(await gathering.read())
    await gathering.done_writing()
    assert budget.held == 0


# -- 2. bodies that cost the most to parse -------------------------------------------


def _hostile(shape: bytes, path_key: bytes) -> bytes:
    """A 4 MiB body whose prompt list repeats ``shape``."""
    head = b'{"model": "m", "' + path_key + b'": ['
    count = (4 * MIB - len(head)) // (len(shape) + 1)
    return head + b",".join([shape] * count) + b"]}"


HOSTILE = {
    "empty messages": (_hostile(b"{}", b"messages"), "/v1/chat/completions"),
    "one-id token lists": (_hostile(b"[1]", b"prompt"), "/v1/completions"),
    "token ids": (_hostile(b"1", b"prompt"), "/v1/completions"),
    "empty strings": (_hostile(b'""', b"input"), "/v1/embeddings"),
    "empty input items": (_hostile(b"{}", b"input"), "/v1/responses"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_body_is_a_400_without_building_its_structure(name: str) -> None:
    """Old: 1-4 s of CPU and ~200 MB per body. Now the 400 comes from counting the
    body's bytes: at most one copy of them (the count without strings) is made."""
    raw, path = HOSTILE[name]
    tracemalloc.start()
    try:
        with pytest.raises(RequestError) as caught:
            parse_body(raw, path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.status == 400
    assert caught.value.code in ("body_too_complex", "too_many_items")
    assert peak < 2.5 * len(raw)


def test_bodies_at_the_limits_are_read() -> None:
    """The bounds are past what real requests hold: at them a body is routed."""
    messages = [{"role": "user", "content": "hi, there"}] * MAX_PROMPT_ITEMS
    parse_body(json.dumps({"model": "m", "messages": messages}).encode(), "/v1/chat/completions")
    parts = [{"type": "text", "text": "{[, " * 100}] * 3  # brackets and commas in text
    with_parts = [{"role": "user", "content": parts}] * (MAX_JSON_CONTAINERS // 5 - 1)
    chat = json.dumps({"model": "m", "messages": with_parts}).encode()
    assert chat.count(b"{") + chat.count(b"[") > MAX_JSON_CONTAINERS  # counted exactly
    parse_body(chat, "/v1/chat/completions")
    strings = ["a"] * MAX_PROMPT_ITEMS
    parse_body(json.dumps({"model": "m", "input": strings}).encode(), "/v1/embeddings")
    ids = list(range(MAX_JSON_VALUES - 10))
    parsed = parse_body(json.dumps({"model": "m", "prompt": ids}).encode(), "/v1/completions")
    assert parsed.request.prompt_tokens == len(ids)


async def test_others_are_served_while_a_client_sends_hostile_bodies() -> None:
    rig = await RequestRig(ServingSettings()).start()
    try:
        hostile = [
            rig.envoy.exchange(request_headers(path=path), request_body(raw))
            for raw, path in HOSTILE.values()
        ]
        normal = [
            rig.envoy.exchange(request_headers(), request_body(completions(2000)))
            for _ in range(20)
        ]
        answers = await asyncio.gather(*hostile, *normal)
    finally:
        await rig.stop()
    for _, reply in answers[: len(hostile)]:
        assert error_of(reply)[0] == 400
    assert all(routed(reply) for _, reply in answers[len(hostile) :])
    assert rig.processor.body_budget.held == 0


# -- 6 and 9a: values that break what is built from them --------------------------


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": "p", "max_tokens": ' + b"9" * 400 + b"}",
        b'{"model": "m", "prompt": "p", "max_tokens": 1' + b"0" * 300 + b"}",
        b'{"model": "m", "prompt": "p", "max_completion_tokens": 9223372036854775808}',
        b'{"model": "m", "prompt": "p", "max_tokens": 1e300}',
    ],
)
async def test_an_absurd_max_tokens_is_a_400(request_rig: RequestRig, body: bytes) -> None:
    _, reply = await request_rig.envoy.exchange(request_headers(), request_body(body))
    status, error = error_of(reply)
    assert (status, error["code"]) == (400, "invalid_max_tokens")
    assert str(MAX_COMPLETION_TOKENS) in error["message"]
    assert request_rig.router.seen == []


async def test_the_largest_max_tokens_is_routed(request_rig: RequestRig) -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": MAX_COMPLETION_TOKENS}
    _, reply = await request_rig.envoy.exchange(request_headers(), request_body(body))
    assert routed(reply)
    assert request_rig.router.seen[0].max_tokens == MAX_COMPLETION_TOKENS


@pytest.mark.parametrize(
    ("body", "path"),
    [
        (rb'{"model": "m", "prompt": "\ud800"}', "/v1/completions"),
        (rb'{"model": "\udfff", "prompt": "p"}', "/v1/completions"),
        (rb'{"model": "m", "prompt": "p", "x\uDBFF": 1}', "/v1/completions"),
        (rb'{"model": "m", "messages": [{"role": "user", "content": "a\ud83d"}]}', "/other"),
        (b'{"model": "m", "prompt": "\xed\xa0\x80"}', "/v1/completions"),  # encoded surrogate
    ],
)
async def test_a_lone_surrogate_is_a_400_with_a_json_message(
    request_rig: RequestRig, body: bytes, path: str
) -> None:
    request_rig.router.decision = None
    _, reply = await request_rig.envoy.exchange(request_headers(path=path), request_body(body))
    status, error = error_of(reply)
    assert (status, error["code"]) == (400, "invalid_json")
    assert request_rig.router.seen == []
    # The server keeps serving, and a valid pair (an emoji an ASCII encoder escaped) is routed.
    _, reply = await request_rig.envoy.exchange(
        request_headers(), request_body(rb'{"model": "m", "prompt": "\ud83d\ude00 \\ud800"}')
    )
    assert routed(reply)
    # 8 characters: the emoji, a space and the text "\\ud800" (an escaped backslash)
    assert request_rig.router.seen[0].prompt_tokens == 2


# -- 3. large answers and the usage they carry --------------------------------------


async def test_concurrent_large_answers_hold_only_their_usage_members() -> None:
    """Fifty answers of 2 MiB each (usage followed by a large ``prompt_logprobs``, as
    vLLM orders them) hold at most ``MAX_USAGE_BYTES`` each while they stream, all
    of it under the server's budget, and each answer's usage is still read."""
    rig = await RequestRig(ServingSettings()).start()
    budget = rig.processor.usage_budget
    answers = 50
    chunk = b"0.5," * (64 * 1024)  # 256 KiB
    peak = 0
    try:
        calls = []
        for index in range(answers):
            call = rig.envoy.open()
            await call.write(request_headers({"x-request-id": f"r{index}"}))
            await call.read()
            await call.write(request_body(completions(100)))
            assert routed(await call.read())
            await call.write(response_headers())
            await call.read()
            head = b'{"choices": [{"text": "' + b"t" * 200_000 + b'"}], "usage": '
            usage = {"prompt_tokens": index + 1, "completion_tokens": 2}
            await call.write(
                response_body(head + json.dumps(usage).encode() + b', "prompt_logprobs": [')
            )
            await call.read()
            calls.append(call)
        for _ in range(7):
            for call in calls:
                await call.write(response_body(chunk))
                await call.read()
            peak = max(peak, budget.held)
        for call in calls:
            await call.write(response_body(b"0.5]}", end_of_stream=True))
            await call.read()
            await call.done_writing()
        await settled(rig.server)
    finally:
        await rig.stop()
    assert peak <= answers * MAX_USAGE_BYTES <= budget.limit
    assert budget.held == 0
    prompts = sorted(span.ends[0]["prompt_tokens"] for span in rig.telemetry.spans)
    assert prompts == list(range(1, answers + 1))


async def test_past_the_usage_budget_answers_pass_through_unread() -> None:
    rig = await RequestRig(ServingSettings(max_usage_bytes=MAX_USAGE_BYTES)).start()
    budget = rig.processor.usage_budget
    try:
        calls = []
        for _ in range(3):
            call = rig.envoy.open()
            await call.write(request_headers())
            await call.read()
            await call.write(request_body(completions(100)))
            await call.read()
            await call.write(response_headers())
            await call.read()
            answer = b'{"usage": {"prompt_tokens": 1}, "x": "' + b"y" * 40_000
            await call.write(response_body(answer))
            reply = await call.read()
            assert reply.WhichOneof("response") == "response_body"  # passed on
            calls.append(call)
        assert budget.held <= budget.limit
        assert budget.refused >= 1
        for call in calls:
            await call.write(response_body(b'"}', end_of_stream=True))
            await call.read()
            await call.done_writing()
    finally:
        await rig.stop()
    assert budget.held == 0


def test_short_strings_and_numbers_past_the_values_limit_are_a_400() -> None:
    """Without its strings this body is shorter than two bytes a value, yet its
    values are over the limit: the exact count still sees them."""
    items = ["a"] * 200_000 + [1] * (MAX_JSON_VALUES - 200_000 + 10)
    raw = json.dumps({"model": "m", "data": items}, separators=(",", ":")).encode()
    with pytest.raises(RequestError) as caught:
        parse_body(raw, "/v1/other")
    assert caught.value.code == "body_too_complex"
