"""Telemetry through the real ext_proc server: real gRPC, the real Router, a real policy."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc_support import (
    EnvoySide,
    Snapshot,
    error_of,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
    settled,
)
from telemetry_support import Spans, pods, router_for

from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.extproc.settlement import Settlement
from policyd.policy import Router
from policyd.policy.decision import Decision, ShadowReport
from policyd.policy.request import Request
from policyd.telemetry import DecisionMetrics, DecisionTelemetry
from policyd.telemetry import attributes as a

CARRIER = ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
BODY = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@dataclass
class Rig:
    server: ExtProcServer
    envoy: EnvoySide
    metrics: DecisionMetrics
    router: Router


@pytest.fixture
async def rig(tmp_path: Path, spans: Spans) -> AsyncIterator[Rig]:
    router = router_for(tmp_path)
    metrics = DecisionMetrics()
    telemetry = DecisionTelemetry(tracer=spans.tracer, metrics=metrics)
    snapshot = Snapshot(tuple(pods()))
    server = ExtProcServer(
        lambda: router,
        lambda: snapshot,
        telemetry=telemetry,
        options=ServerOptions(port=0, grace_seconds=0.5),
    )
    await server.start()
    envoy = EnvoySide(server.port)
    yield Rig(server, envoy, metrics, router)
    await envoy.close()
    await server.stop(0)


def chat_headers() -> Any:
    return request_headers({"x-request-id": "req-42"}, path="/v1/chat/completions")


async def test_one_exchange_makes_one_complete_span(rig: Rig, spans: Spans) -> None:
    usage = {"usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    call = rig.envoy.open(metadata=[CARRIER])
    replies = []
    for message in (
        chat_headers(),
        request_body(BODY),
        response_headers(200),
        response_body(json.dumps(usage).encode(), end_of_stream=True),
    ):
        await call.write(message)
        replies.append(await call.read())
    await call.done_writing()
    await settled(rig.server)
    traceparent = set_headers(replies[1])["traceparent"].header.raw_value.decode()
    span = spans.only()
    assert span.context is not None
    assert traceparent == f"00-4bf92f3577b34da6a3ce929d0e0e4736-{span.context.span_id:016x}-01"
    attributes = dict(span.attributes or {})
    assert attributes[a.REQUEST_ID] == "req-42"
    assert attributes[a.GEN_AI_OPERATION] == "chat"
    assert attributes[a.POD] == "a"
    assert attributes[a.HTTP_STATUS] == 200
    assert attributes[a.GEN_AI_INPUT_TOKENS] == 9
    assert attributes[a.GEN_AI_OUTPUT_TOKENS] == 4
    assert attributes[a.RESPONSE_COMPLETED] is True
    assert a.TIME_TO_FIRST_TOKEN in attributes
    assert attributes[a.SHADOWS] == 1
    registry = rig.metrics.registry
    routed = {
        "policy": "live",
        "outcome": "routed",
        "model_server_endpoint": "a",
        "model_name": "llama",
    }
    assert registry.get_sample_value("policyd_decisions_total", routed) == 1


async def test_the_span_ends_when_the_response_ended_not_when_it_was_settled(
    rig: Rig, spans: Spans
) -> None:
    # Settle well after the replies, so a span ended at settlement could not pass.
    rig.server.processor.settlement = Settlement(delay_seconds=0.2)
    call = rig.envoy.open(metadata=[CARRIER])
    for message in (chat_headers(), request_body(BODY), response_headers(200)):
        await call.write(message)
        await call.read()
    before_end = time.time_ns()
    await call.write(response_body(b"{}", end_of_stream=True))
    await call.read()
    after_end = time.time_ns()
    await call.done_writing()
    await settled(rig.server)
    span = spans.only()
    assert span.start_time is not None and span.end_time is not None
    assert span.start_time < before_end <= span.end_time <= after_end
    duration = dict(span.attributes or {})[a.RESPONSE_DURATION]
    decision = dict(span.attributes or {})[a.DECISION_DURATION]
    assert span.end_time - span.start_time == pytest.approx((decision + duration) * 1e9, abs=1e4)


async def test_stream_errors_reach_the_metrics(rig: Rig, spans: Spans) -> None:
    replies = await rig.envoy.exchange(chat_headers(), request_body(b"{not json"))
    assert error_of(replies[1])[0] == 400
    call = rig.envoy.open()
    await call.write(chat_headers())
    await call.read()
    await call.write(request_body(BODY))
    await call.read()
    call.cancel()  # the client went away mid-response
    registry = rig.metrics.registry
    for _ in range(1500):
        aborted = {"kind": "aborted", "code": "decided"}
        if registry.get_sample_value("policyd_extproc_stream_errors_total", aborted):
            break
        await asyncio.sleep(0.02)
    assert registry.get_sample_value("policyd_extproc_stream_errors_total", aborted) == 1
    rejected = {"kind": "rejected", "code": "invalid_json"}
    assert registry.get_sample_value("policyd_extproc_stream_errors_total", rejected) == 1
    (span,) = spans.finished()  # the cancelled one: ended, not completed
    assert dict(span.attributes or {})[a.RESPONSE_COMPLETED] is False


class SlowShadows:
    """The real Router, with shadow evaluation slowed down so its timing is visible."""

    delay = 2.0  # long enough that a client thread a loaded machine runs late still wins

    def __init__(self, router: Router) -> None:
        self.router = router
        self.shadow_started = 0.0
        self.shadow_ended = 0.0

    def decide(self, request: Request, candidates: Sequence[Any], prompt: Any = None) -> Decision:
        return self.router.decide(request, candidates)

    def decide_shadows(self, decision: Decision) -> ShadowReport | None:
        self.shadow_started = time.monotonic()
        time.sleep(self.delay)  # blocks the event loop, as CPU-bound shadows would
        report = self.router.decide_shadows(decision)
        self.shadow_ended = time.monotonic()
        return report


def exchange_in_a_thread(port: int, done: threading.Event) -> float:
    """Play Envoy from another thread; return when the routing reply arrived."""

    def messages() -> Iterator[Any]:
        yield request_headers(path="/v1/chat/completions")
        yield request_body(BODY)
        done.wait(10)  # keep the stream open until the test has its answer

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        replies = pb_grpc.ExternalProcessorStub(channel).Process(messages(), timeout=10)
        next(replies)
        route = next(replies)
        arrived = time.monotonic()
        assert "traceparent" in set_headers(route)
        done.set()
        for _ in replies:
            pass
        return arrived


async def test_shadows_run_after_the_live_reply_has_gone_out(rig: Rig, spans: Spans) -> None:
    slow = SlowShadows(rig.router)
    rig.server.processor.routers = lambda: slow
    done = threading.Event()
    replied = await asyncio.to_thread(exchange_in_a_thread, rig.server.port, done)
    await settled(rig.server)
    assert slow.shadow_ended > 0, "the shadows were evaluated"
    # The client had the routing reply while the shadows were still running:
    # they did not delay it (were they evaluated before the reply, the reply
    # could only arrive after shadow_ended).
    assert replied < slow.shadow_ended
    assert dict(spans.only().attributes or {})[a.SHADOWS] == 1


async def one_exchange_attributes(
    rig: Rig, spans: Spans, path: str, body: dict[str, Any], usage: dict[str, Any]
) -> dict[str, Any]:
    """The decision span's attributes of one exchange to ``path`` answered 200 with ``usage``."""
    call = rig.envoy.open(metadata=[CARRIER])
    for message in (
        request_headers({}, path=path),
        request_body(body),
        response_headers(200),
        response_body(json.dumps({"usage": usage}).encode(), end_of_stream=True),
    ):
        await call.write(message)
        await call.read()
    await call.done_writing()
    await settled(rig.server)
    span = spans.only()
    assert span.name == f"chat {body['model']}"
    return dict(span.attributes or {})


async def test_an_anthropic_messages_request_is_a_chat_with_its_cache_reads_in_gen_ai_usage(
    rig: Rig, spans: Spans
) -> None:
    usage = {"input_tokens": 3, "output_tokens": 4, "cache_read_input_tokens": 96}
    attributes = await one_exchange_attributes(rig, spans, "/v1/messages", BODY, usage)
    assert attributes[a.GEN_AI_OPERATION] == "chat"
    assert attributes[a.GEN_AI_PROVIDER] == "anthropic"
    assert attributes[a.GEN_AI_CACHED_TOKENS] == 96
    assert attributes[a.GEN_AI_INPUT_TOKENS] == 99  # Anthropic counts cache reads apart
    assert attributes[a.GEN_AI_OUTPUT_TOKENS] == 4
    assert a.GEN_AI_REQUEST_STREAM not in attributes  # set only for a streaming request


async def test_an_openai_chat_names_its_provider_its_stream_and_its_cached_tokens(
    rig: Rig, spans: Spans
) -> None:
    usage = {
        "prompt_tokens": 40,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    body = {**BODY, "stream": True}
    attributes = await one_exchange_attributes(rig, spans, "/v1/chat/completions", body, usage)
    assert attributes[a.GEN_AI_OPERATION] == "chat"
    assert attributes[a.GEN_AI_PROVIDER] == "openai"
    assert attributes[a.GEN_AI_REQUEST_STREAM] is True
    assert attributes[a.GEN_AI_CACHED_TOKENS] == 32
    assert attributes[a.GEN_AI_INPUT_TOKENS] == 40
