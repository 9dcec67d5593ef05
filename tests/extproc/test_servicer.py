"""The ext_proc stream, phase by phase, over a real gRPC channel."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from extproc_support import (
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
    set_headers,
    settled,
)

from policyd.extproc.exchange import Exchange
from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.extproc.interfaces import NULL_SPAN
from policyd.extproc.process_stream import ExternalProcessor
from policyd.extproc.replies import DESTINATION_HEADER, PREFILL_HEADER
from policyd.extproc.serving import ServingSettings
from policyd.policy.decision import Decision, Outcome
from policyd.pool.pod import Pod

BODY = {"model": "m", "prompt": "hello"}


@dataclass
class Rig:
    server: ExtProcServer
    envoy: EnvoySide
    telemetry: RecordingTelemetry
    pods: tuple[Pod, ...]
    router: PickFirst = field(default_factory=PickFirst)
    snapshot: Snapshot = field(default_factory=lambda: Snapshot(()))


async def start_rig(settings: ServingSettings | None = None) -> Rig:
    pods = (Pod("pod-a", "10.0.0.1:8000"), Pod("pod-b", "10.0.0.2:8000"))
    telemetry = RecordingTelemetry()
    holder: list[Rig] = []
    server = ExtProcServer(
        lambda: holder[0].router,
        lambda: holder[0].snapshot,
        telemetry=telemetry,
        options=ServerOptions(port=0, settings=settings or ServingSettings()),
    )
    await server.start()
    rig = Rig(server, EnvoySide(server.port), telemetry, pods, snapshot=Snapshot(pods))
    holder.append(rig)
    return rig


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    rig = await start_rig()
    yield rig
    await rig.envoy.close()
    await rig.server.stop(0)


async def test_request_headers_continue_and_strip_a_client_destination(rig: Rig) -> None:
    call = rig.envoy.open()
    await call.write(request_headers({DESTINATION_HEADER: "6.6.6.6:80"}))
    reply = await call.read()
    mutation = reply.request_headers.response.header_mutation
    assert list(mutation.remove_headers) == [DESTINATION_HEADER, PREFILL_HEADER]
    assert not mutation.set_headers
    call.cancel()


async def test_the_routing_reply_follows_the_wire_facts(rig: Rig) -> None:
    _, reply = await rig.envoy.exchange(request_headers(), request_body(BODY))
    common = reply.request_body.response
    header = set_headers(reply)[DESTINATION_HEADER]
    assert header.header.raw_value == b"10.0.0.1:8000"
    assert header.header.value == ""  # raw_value only: both would make Envoy answer 500
    assert header.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields[DESTINATION_HEADER].string_value == "10.0.0.1:8000"
    assert common.clear_route_cache
    assert not common.HasField("body_mutation")  # the model was not rewritten
    assert "content-length" not in set_headers(reply)


async def test_fallbacks_follow_the_pick_when_enabled() -> None:
    rig = await start_rig(ServingSettings(send_fallbacks=True))
    try:
        _, reply = await rig.envoy.exchange(request_headers(), request_body(BODY))
    finally:
        await rig.envoy.close()
        await rig.server.stop(0)
    expected = b"10.0.0.1:8000,10.0.0.2:8000"
    assert set_headers(reply)[DESTINATION_HEADER].header.raw_value == expected
    lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields[DESTINATION_HEADER].string_value == expected.decode()


async def test_a_model_rewrite_replaces_the_body_and_its_length(rig: Rig) -> None:
    pod = rig.pods[1]
    rig.router.decision = Decision(
        Outcome.ROUTED, "p", "1", "m-lora", endpoint=pod.address, pod=pod.name
    )
    _, reply = await rig.envoy.exchange(request_headers(), request_body(BODY))
    new_body = reply.request_body.response.body_mutation.body
    assert json.loads(new_body) == {**BODY, "model": "m-lora"}
    assert set_headers(reply)["content-length"].header.raw_value == str(len(new_body)).encode()
    assert set_headers(reply)[DESTINATION_HEADER].header.raw_value == pod.address.encode()


async def test_a_streamed_body_is_gathered_until_its_end(rig: Rig) -> None:
    raw = json.dumps(BODY).encode()
    first, second, last = await rig.envoy.exchange(
        request_headers(body_mode=Mode.STREAMED),
        request_body(raw[:7], end_of_stream=False),
        request_body(raw[7:], end_of_stream=True),
    )
    assert first.WhichOneof("response") == "request_headers"
    assert second.WhichOneof("response") == "request_body"
    assert not second.request_body.response.header_mutation.set_headers  # not decided yet
    assert DESTINATION_HEADER in set_headers(last)
    assert rig.router.seen[0].prompt_tokens == 2


async def test_a_buffered_body_followed_by_trailers_is_routed_at_once(rig: Rig) -> None:
    _, reply = await rig.envoy.exchange(request_headers(), request_body(BODY, end_of_stream=False))
    assert DESTINATION_HEADER in set_headers(reply)


async def test_trailers_after_a_streamed_body_cannot_be_routed_and_say_so(rig: Rig) -> None:
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    _, _, reply = await rig.envoy.exchange(
        request_headers(body_mode=Mode.STREAMED),
        request_body(BODY, end_of_stream=False),
        trailers,
    )
    status, error = error_of(reply)
    assert (status, error["code"]) == (400, "unsupported_trailers")


async def test_trailers_after_a_routed_request_continue(rig: Rig) -> None:
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    replies = await rig.envoy.exchange(request_headers(), request_body(BODY), trailers)
    assert replies[2].WhichOneof("response") == "request_trailers"


async def test_a_body_cut_by_envoys_partial_buffer_is_a_413(rig: Rig) -> None:
    _, reply = await rig.envoy.exchange(
        request_headers(body_mode=Mode.BUFFERED_PARTIAL),
        request_body(b'{"model"', end_of_stream=False),
    )
    assert error_of(reply)[0] == 413
    assert rig.router.seen == []


@pytest.mark.parametrize(
    ("mode", "end_of_stream"),
    [(Mode.STREAMED, False), (Mode.BUFFERED, True)],  # gathered, and whole in one message
)
async def test_a_body_larger_than_policyd_accepts_is_a_413(mode: int, end_of_stream: bool) -> None:
    rig = await start_rig(ServingSettings(max_body_bytes=10))
    try:
        _, reply = await rig.envoy.exchange(
            request_headers(body_mode=mode), request_body(b"x" * 11, end_of_stream=end_of_stream)
        )
    finally:
        await rig.envoy.close()
        await rig.server.stop(0)
    assert error_of(reply)[0] == 413


async def test_a_post_without_a_body_is_a_400(rig: Rig) -> None:
    (reply,) = await rig.envoy.exchange(request_headers(end_of_stream=True))
    status, error = error_of(reply)
    assert (status, error["code"]) == (400, "missing_body")


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_a_get_without_a_body_goes_to_the_least_busy_pod_by_its_headers_reply(
    rig: Rig, method: str
) -> None:
    busy, idle = rig.pods
    busy.load.count = 2
    call = rig.envoy.open()
    await call.write(request_headers({":method": method}, path="/v1/models", end_of_stream=True))
    reply = await call.read()
    assert (busy.in_flight, idle.in_flight) == (2, 1)  # counted against the pod it went to
    for message in (response_headers(200), response_body(b"{}", end_of_stream=True)):
        await call.write(message)
        await call.read()
    await call.done_writing()
    assert reply.WhichOneof("response") == "request_headers"
    common = reply.request_headers.response
    header = set_headers(reply)[DESTINATION_HEADER]
    assert header.header.raw_value == b"10.0.0.2:8000"
    assert header.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert common.clear_route_cache
    lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields[DESTINATION_HEADER].string_value == "10.0.0.2:8000"
    trace = set_headers(reply)["traceparent"].header.raw_value  # the span's, to the pod
    assert trace == b"00-11111111111111111111111111111111-2222222222222222-01"
    assert rig.router.seen == []  # no model, so no policy was asked
    (decision,) = rig.telemetry.decisions
    assert (decision.outcome, decision.pod, decision.policy) == (Outcome.ROUTED, "pod-b", "")
    assert decision.reason == "no body: the ready pod with the fewest requests in flight"
    assert idle.in_flight == 0  # released when the response ended


async def test_a_get_without_a_body_and_no_ready_pod_is_a_503(rig: Rig) -> None:
    rig.snapshot = Snapshot(())
    (reply,) = await rig.envoy.exchange(
        request_headers({":method": "GET"}, path="/v1/models", end_of_stream=True)
    )
    status, error = error_of(reply)
    assert (status, error["code"]) == (503, "no_ready_endpoints")


async def test_headers_reach_the_router_lower_cased_joined_and_without_pseudo_headers(
    rig: Rig,
) -> None:
    message = request_headers({"X-Tenant": "t1"})
    message.request_headers.headers.headers.add(key="x-tag", raw_value=b"a")
    message.request_headers.headers.headers.add(key="x-tag", raw_value=b"b")
    message.request_headers.headers.headers.add(key="x-legacy", value="plain")
    message.request_headers.headers.headers[1].raw_value = b"/v1/completions?debug=1"
    await rig.envoy.exchange(message, request_body(BODY))
    seen = rig.router.seen[0]
    assert seen.headers["x-tenant"] == "t1"
    assert seen.headers["x-tag"] == "a,b"
    assert seen.headers["x-legacy"] == "plain"
    assert not any(name.startswith(":") for name in seen.headers)
    assert (seen.path, seen.id) == ("/v1/completions", "req-1")


@pytest.mark.parametrize(
    ("outcome", "status"),
    [
        (Outcome.SHED, 429),
        (Outcome.NO_CAPACITY, 503),
        (Outcome.UNKNOWN_MODEL, 404),
        (Outcome.ERROR, 500),
    ],
)
async def test_an_unrouted_decision_is_an_immediate_json_error(
    rig: Rig, outcome: Outcome, status: int
) -> None:
    rig.router.decision = Decision(outcome, "p", "1", "m", reason=f"because {outcome.value}")
    _, reply = await rig.envoy.exchange(request_headers(), request_body(BODY))
    got_status, error = error_of(reply)
    assert (got_status, error["message"]) == (status, f"because {outcome.value}")
    content_type = reply.immediate_response.headers.set_headers[0].header
    assert (content_type.key, content_type.raw_value) == ("content-type", b"application/json")
    await settled(rig.server)
    assert rig.telemetry.spans[0].statuses == [status]
    assert rig.telemetry.spans[0].ends[0]["completed"] is True


async def test_a_router_that_raises_is_a_500_and_the_next_request_is_fine(rig: Rig) -> None:
    rig.router.error = KeyError("boom")
    _, reply = await rig.envoy.exchange(request_headers(), request_body(BODY))
    status, error = error_of(reply)
    assert (status, error["code"]) == (500, "policy_error")
    assert rig.telemetry.decisions[0].outcome is Outcome.ERROR
    rig.router.error = None
    _, reply = await rig.envoy.exchange(request_headers(), request_body(BODY))
    assert DESTINATION_HEADER in set_headers(reply)


async def test_a_routed_decision_without_an_endpoint_is_a_500(rig: Rig) -> None:
    rig.router.decision = Decision(Outcome.ROUTED, "p", "1", "m")
    _, reply = await rig.envoy.exchange(request_headers(), request_body(BODY))
    assert error_of(reply)[0] == 500


async def test_a_pool_that_cannot_give_a_snapshot_is_a_500(rig: Rig) -> None:
    rig.snapshot = None  # type: ignore[assignment]  # .candidates now raises
    _, reply = await rig.envoy.exchange(request_headers(), request_body(BODY))
    assert error_of(reply)[0] == 500


@pytest.mark.parametrize("hook", ["start", "upstream_headers", "response_headers", "end"])
async def test_a_telemetry_bug_never_fails_the_request(rig: Rig, hook: str) -> None:
    rig.telemetry.fail_on = hook
    replies = await rig.envoy.exchange(
        request_headers(),
        request_body(BODY),
        response_headers(),
        response_body(b"{}", end_of_stream=True),
    )
    assert DESTINATION_HEADER in set_headers(replies[1])
    kinds = [r.WhichOneof("response") for r in replies]
    # The response's last chunk is answered by the stream's status OK.
    assert kinds == ["request_headers", "request_body", "response_headers"]


async def test_the_trace_context_is_envoys_from_grpc_metadata_else_the_clients(rig: Rig) -> None:
    client = "00-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-bbbbbbbbbbbbbbbb-01"
    envoys = "00-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-cccccccccccccccc-01"
    call = rig.envoy.open(metadata=[("traceparent", envoys), ("tracestate", "")])
    await call.write(request_headers({"traceparent": client}))
    await call.read()
    await call.write(request_body(BODY))
    await call.read()
    await call.done_writing()
    await rig.envoy.exchange(request_headers({"traceparent": client}), request_body(BODY))
    await rig.envoy.exchange(request_headers(), request_body(BODY))
    carriers = [span.carrier for span in rig.telemetry.spans]
    assert carriers == [{"traceparent": envoys}, {"traceparent": client}, {}]


async def test_telemetry_trace_headers_go_to_the_model_server(rig: Rig) -> None:
    _, reply = await rig.envoy.exchange(request_headers(), request_body(BODY))
    assert set_headers(reply)["traceparent"].header.raw_value.startswith(b"00-1111")


async def test_the_response_is_recorded_and_the_pod_released_at_its_end(rig: Rig) -> None:
    chunks = [
        b'data: {"choices":[{"text":"a"}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1}}\n\n'
        b"data: [DONE]\n\n",
    ]
    call = rig.envoy.open()
    for message in (request_headers(), request_body({**BODY, "stream": True})):
        await call.write(message)
        await call.read()
    assert [p.in_flight for p in rig.pods] == [1, 0]
    await call.write(response_headers(200, "text/event-stream"))
    assert (await call.read()).WhichOneof("response") == "response_headers"
    await call.write(response_body(chunks[0]))
    await call.read()
    await settled(rig.server)
    assert rig.telemetry.spans[0].ends == []
    await call.write(response_body(chunks[1], end_of_stream=True))
    await call.read()
    assert [p.in_flight for p in rig.pods] == [0, 0]  # at once, not when settled
    await settled(rig.server)
    span = rig.telemetry.spans[0]
    assert span.statuses == [200]
    assert len(span.ends) == 1
    assert span.ends[0]["completed"] is True
    assert (span.ends[0]["prompt_tokens"], span.ends[0]["completion_tokens"]) == (2, 1)
    assert span.ends[0]["first_body_seconds"] <= span.ends[0]["duration_seconds"]
    assert [p.in_flight for p in rig.pods] == [0, 0]
    await call.done_writing()


async def test_a_response_without_a_body_ends_at_its_headers(rig: Rig) -> None:
    await rig.envoy.exchange(
        request_headers(), request_body(BODY), response_headers(204, "", end_of_stream=True)
    )
    assert rig.pods[0].in_flight == 0
    await settled(rig.server)
    assert rig.telemetry.spans[0].ends[0]["completed"] is True
    assert rig.telemetry.spans[0].ends[0]["first_body_seconds"] is None
    assert rig.pods[0].in_flight == 0


async def test_a_stream_that_ends_early_releases_the_pod_and_says_so(rig: Rig) -> None:
    call = rig.envoy.open()
    for message in (request_headers(), request_body(BODY), response_headers()):
        await call.write(message)
        await call.read()
    assert rig.pods[0].in_flight == 1
    call.cancel()  # the client went away mid-response
    for _ in range(3000):
        if rig.telemetry.spans[0].ends:
            break
        await asyncio.sleep(0.01)
    assert rig.telemetry.spans[0].ends[0]["completed"] is False
    assert rig.pods[0].in_flight == 0


class _Context:
    """What ``Process`` reads of a grpc.aio servicer context."""

    @staticmethod
    def invocation_metadata() -> tuple[tuple[str, str], ...]:
        return ()


async def cancelled_after(*messages: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingRequest]:
    """Envoy's messages, then what grpc raises into the handler when Envoy's reset
    arrives while it waits for the next one (seen through the real Envoy:
    tests/e2e/test_stream_close.py)."""
    for message in messages:
        yield message
    raise asyncio.CancelledError


FULL_EXCHANGE = (
    request_headers(),
    request_body(BODY),
    response_headers(),
    response_body(b"{}", end_of_stream=True),
)


async def read_once(*messages: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingRequest]:
    """Envoy's messages; a read past them fails the test (a read left pending when
    Envoy resets the stream is what grpcio leaks, grpc/grpc#43360)."""
    for message in messages:
        yield message
    raise AssertionError("policyd read again after the exchange had ended")


async def test_the_responses_last_message_is_answered_by_the_status_and_nothing_is_read_after(
    rig: Rig,
) -> None:
    """No reply to it: Envoy resets a stream once it has the last reply, and the
    status OK sent after such a reset is a failed batch grpcio leaks (grpc/grpc#43360)."""
    replies_sent = [
        r async for r in rig.server.processor.Process(read_once(*FULL_EXCHANGE), _Context())
    ]
    assert len(replies_sent) == len(FULL_EXCHANGE) - 1
    await settled(rig.server)
    assert rig.telemetry.spans[0].ends[0]["completed"] is True
    assert rig.telemetry.stream_errors == []


ANSWERED = (request_headers(), request_body(b"{not json"))  # policyd answers 400 itself


async def test_a_finished_stream_that_envoy_resets_is_counted_as_a_normal_end_and_not_logged(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(2):
        stream = rig.server.processor.Process(read_once(*ANSWERED), _Context())
        await anext(stream)
        assert error_of(pb.ProcessingResponse.FromString(await anext(stream)))[0] == 400
        with pytest.raises(asyncio.CancelledError):  # the reset, as the answer goes out
            await stream.athrow(asyncio.CancelledError())
    assert rig.telemetry.stream_errors == [("rejected", "invalid_json"), ("reset", "after_end")] * 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_stream_reset_before_its_end_is_aborted_not_reset(rig: Rig) -> None:
    with pytest.raises(asyncio.CancelledError):
        async for _reply in rig.server.processor.Process(
            cancelled_after(*FULL_EXCHANGE[:3]), _Context()
        ):
            pass
    assert rig.telemetry.stream_errors == [("aborted", "decided")]


async def test_a_stream_closed_gracefully_is_no_reset(rig: Rig) -> None:
    await rig.envoy.exchange(*FULL_EXCHANGE)
    await settled(rig.server)
    assert rig.telemetry.spans[0].ends[0]["completed"] is True
    assert rig.telemetry.stream_errors == []


@pytest.mark.parametrize(
    "pick",
    [
        # the router hands over the pod object (under a name the pool does not know)
        lambda pod: Decision(
            Outcome.ROUTED, "p", "1", "m", endpoint=pod.address, pod="renamed", chosen=pod
        ),
        # a router that names only the endpoint: matched by address
        lambda pod: Decision(Outcome.ROUTED, "p", "1", "m", endpoint=pod.address),
    ],
    ids=["handed-over", "by-address"],
)
async def test_the_picked_pod_counts_the_request_until_it_ends(
    rig: Rig, pick: Callable[[Pod], Decision]
) -> None:
    rig.router.decision = pick(rig.pods[1])
    call = rig.envoy.open()
    for message in (request_headers(), request_body(BODY)):
        await call.write(message)
        await call.read()
    assert [p.in_flight for p in rig.pods] == [0, 1]
    await call.write(response_headers(end_of_stream=True))
    await call.read()
    assert [p.in_flight for p in rig.pods] == [0, 0]
    await call.done_writing()


async def test_many_concurrent_streams_keep_their_own_state(rig: Rig) -> None:
    async def one(index: int) -> tuple[int, str]:
        body = {"model": f"m{index}", "prompt": "p"} if index % 4 else b"{bad"
        replies = await rig.envoy.exchange(
            request_headers({"x-request-id": f"r{index}"}), request_body(body)
        )
        kind = replies[1].WhichOneof("response")
        return index, kind

    results = await asyncio.gather(*(one(i) for i in range(40)))
    for index, kind in results:
        assert kind == ("request_body" if index % 4 else "immediate_response")
    assert sorted(r.model for r in rig.router.seen) == sorted(f"m{i}" for i in range(40) if i % 4)


@pytest.mark.parametrize("reads_carrier", [False, True])
def test_the_streams_metadata_is_read_only_when_telemetry_reads_the_carrier(
    reads_carrier: bool,
) -> None:
    """grpc builds the metadata anew per call: without tracing or a decision log
    (nothing reading the carrier) it is never asked for, and at most once."""
    envoys = "00-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-cccccccccccccccc-01"
    reads: list[int] = []

    def metadata() -> tuple[tuple[str, str], ...]:
        reads.append(1)
        return (("traceparent", envoys),)

    seen: list[dict[str, str]] = []

    class Telemetry(RecordingTelemetry):
        def start(self, request: Any, decision: Any, trace_carrier: Any, seconds: float) -> Any:
            if reads_carrier:
                seen.append(dict(trace_carrier))
                seen.append({"traceparent": trace_carrier["traceparent"]})  # read again
            return NULL_SPAN

    pods = (Pod("pod-0", "10.0.0.1:8000"),)
    router = PickFirst()
    server = ExternalProcessor(
        lambda: router, lambda: Snapshot(pods), Telemetry(), ServingSettings()
    )
    exchange = Exchange(server, metadata)
    clients = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    for message in (request_headers({"traceparent": clients}), request_body(BODY)):
        exchange.handle(message)
        exchange.reply_sent()
    exchange.close()
    assert len(reads) == (1 if reads_carrier else 0)
    assert seen == ([{"traceparent": envoys}] * 2 if reads_carrier else [])
