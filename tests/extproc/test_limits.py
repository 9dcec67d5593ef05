"""What bounds policyd's memory per request and per server, and the in-flight expiry.

Each limit answers with its own status and an OpenAI-style JSON error before
anything is built from the oversized part; the server-wide cap on request-body
bytes held at once answers 429 with ``Retry-After`` and gives its bytes back
however the exchange ends. A routed request that never sees response headers
stops counting in its pod's in-flight after ``in_flight_expiry_seconds``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
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
)

from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.extproc.serving import ServingSettings
from policyd.pool.pod import Pod

PODS = (Pod("pod-a", "10.0.0.1:8000"), Pod("pod-b", "10.0.0.2:8000"))


class Rig:
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

    async def start(self) -> Rig:
        await self.server.start()
        self.envoy = EnvoySide(self.server.port)
        return self

    async def stop(self) -> None:
        await self.envoy.close()
        await self.server.stop(0)

    @property
    def held(self) -> int:
        return self.server.processor.body_budget.held


@pytest.fixture
async def small() -> AsyncIterator[Rig]:
    rig = await Rig(
        ServingSettings(
            max_body_bytes=600,
            max_buffered_body_bytes=1000,
            max_header_bytes=2048,
            max_path_bytes=64,
            max_model_bytes=32,
        )
    ).start()
    yield rig
    await rig.stop()


def body_of(size: int, model: str = "m") -> bytes:
    """A completions body of exactly ``size`` bytes."""
    head = json.dumps({"model": model, "prompt": ""}).encode()
    return head[:-2] + b"x" * (size - len(head)) + b'"}'


def retry_after(reply: pb.ProcessingResponse) -> str | None:
    for option in reply.immediate_response.headers.set_headers:
        if option.header.key == "retry-after":
            value: str = option.header.raw_value.decode()
            return value
    return None


async def test_headers_over_the_limit_are_a_431(small: Rig) -> None:
    (reply,) = await small.envoy.exchange(request_headers({"x-big": "y" * 4096}))
    status, error = error_of(reply)
    assert (status, error["code"]) == (431, "headers_too_large")
    assert error["type"] == "invalid_request_error"
    assert small.telemetry.stream_errors == [("rejected", "headers_too_large")]


async def test_a_path_over_the_limit_is_a_414_and_its_query_does_not_count(small: Rig) -> None:
    (reply,) = await small.envoy.exchange(request_headers(path="/v1/" + "a" * 80 + "/completions"))
    assert error_of(reply)[0] == 414
    _, reply = await small.envoy.exchange(
        request_headers(path="/v1/completions?" + "q" * 500), request_body(body_of(100))
    )
    assert reply.WhichOneof("response") == "request_body"  # routed


@pytest.mark.parametrize("model", ["m" * 33, "é" * 17])  # 33 bytes, 34 bytes in UTF-8
async def test_a_model_name_over_the_limit_is_a_400_before_routing(small: Rig, model: str) -> None:
    _, reply = await small.envoy.exchange(
        request_headers(), request_body({"model": model, "prompt": "hi"})
    )
    status, error = error_of(reply)
    assert (status, error["code"]) == (400, "model_too_long")
    assert small.router.seen == []  # never reached the router, the span or the log
    assert small.telemetry.decisions == []


async def test_a_model_name_at_the_limit_is_routed(small: Rig) -> None:
    _, reply = await small.envoy.exchange(
        request_headers(), request_body({"model": "é" * 16, "prompt": "hi"})
    )
    assert reply.WhichOneof("response") == "request_body"


async def test_a_content_length_over_the_body_limit_is_a_413_at_the_headers(small: Rig) -> None:
    (reply,) = await small.envoy.exchange(request_headers({"content-length": "601"}))
    status, error = error_of(reply)
    assert (status, error["code"]) == (413, "body_too_large")
    assert small.held == 0


async def test_an_absurd_content_length_is_a_413_not_an_internal_error() -> None:
    rig = await Rig(ServingSettings()).start()
    try:  # 5,000 digits: more than int() reads from text (4,300)
        (reply,) = await rig.envoy.exchange(request_headers({"content-length": "9" * 5000}))
    finally:
        await rig.stop()
    assert error_of(reply)[0] == 413


async def test_bodies_over_the_servers_cap_are_a_429_with_retry_after_until_bytes_free(
    small: Rig,
) -> None:
    first = small.envoy.open()
    await first.write(request_headers({"content-length": "450"}))  # reserved: within half
    assert (await first.read()).WhichOneof("response") == "request_headers"
    assert small.held == 450

    (reply,) = await small.envoy.exchange(request_headers({"content-length": "600"}))
    status, error = error_of(reply)
    assert (status, error["code"]) == (429, "too_many_body_bytes")
    assert error["type"] == "rate_limit_exceeded"
    assert retry_after(reply) == "1"
    assert small.held == 450  # the refused request took nothing

    # A small body still fits beside the held one.
    _, reply = await small.envoy.exchange(
        request_headers({"content-length": "300"}), request_body(body_of(300))
    )
    assert reply.WhichOneof("response") == "request_body"

    # The first body arrives and is routed: its bytes are given back at once,
    # though its stream goes on (waiting for the response).
    await first.write(request_body(body_of(450)))
    assert (await first.read()).WhichOneof("response") == "request_body"
    assert small.held == 0
    _, reply = await small.envoy.exchange(
        request_headers({"content-length": "500"}), request_body(body_of(500))
    )
    assert reply.WhichOneof("response") == "request_body"
    await first.done_writing()


async def test_a_body_without_content_length_is_held_when_it_arrives(small: Rig) -> None:
    first = small.envoy.open()
    await first.write(request_headers(body_mode=Mode.STREAMED))
    await first.read()
    await first.write(request_body(b'{"model": "m", "prompt": "' + b"x" * 500, end_of_stream=False))
    assert (await first.read()).WhichOneof("response") == "request_body"  # gathering
    held = small.held
    assert held > 500

    _, reply = await small.envoy.exchange(
        request_headers(body_mode=Mode.STREAMED), request_body(body_of(600))
    )
    assert error_of(reply)[0] == 429
    assert small.held == held
    await first.write(request_body(b'"}', end_of_stream=True))
    assert (await first.read()).WhichOneof("response") == "request_body"
    assert small.held == 0


async def test_a_stream_that_dies_before_its_body_gives_its_bytes_back(small: Rig) -> None:
    call = small.envoy.open()
    await call.write(request_headers({"content-length": "450"}))
    await call.read()
    assert small.held == 450
    call.cancel()
    for _ in range(3000):
        await asyncio.sleep(0.01)
        if small.held == 0:
            break
    assert small.held == 0


async def test_a_rejected_body_gives_its_bytes_back(small: Rig) -> None:
    _, reply = await small.envoy.exchange(
        request_headers({"content-length": "12"}), request_body(b"not json :-(")
    )
    assert error_of(reply)[0] == 400
    assert small.held == 0


async def test_the_server_keeps_serving_through_a_flood_over_its_cap(small: Rig) -> None:
    async def one() -> int:
        call = small.envoy.open()
        for message in (request_headers({"content-length": "600"}), request_body(body_of(600))):
            await call.write(message)
            reply = await call.read()
            if reply.HasField("immediate_response"):
                return error_of(reply)[0]  # policyd ended the stream with its answer
        await call.done_writing()
        return 200

    statuses = await asyncio.gather(*(one() for _ in range(40)))
    assert set(statuses) <= {200, 429}
    assert 200 in statuses
    assert small.held == 0
    _, reply = await small.envoy.exchange(
        request_headers({"content-length": "100"}), request_body(body_of(100))
    )
    assert reply.WhichOneof("response") == "request_body"


def test_the_settings_refuse_a_total_below_one_body() -> None:
    with pytest.raises(ValueError, match="at least one body"):
        ServingSettings(max_body_bytes=100, max_buffered_body_bytes=99)


# -- in-flight expiry --------------------------------------------------------------


@pytest.fixture
async def expiring() -> AsyncIterator[Rig]:
    rig = await Rig(ServingSettings(in_flight_expiry_seconds=0.2)).start()
    yield rig
    await rig.stop()


async def routed(rig: Rig) -> object:
    call = rig.envoy.open()
    await call.write(request_headers())
    await call.read()
    await call.write(request_body({"model": "m", "prompt": "hi"}))
    assert (await call.read()).WhichOneof("response") == "request_body"
    return call


async def test_a_routed_request_without_response_headers_leaves_in_flight(expiring: Rig) -> None:
    pod = PODS[0]
    call: object = await routed(expiring)
    assert pod.in_flight == 1
    async with asyncio.timeout(30):  # generous: fails only if it never expires
        while pod.in_flight:
            await asyncio.sleep(0.01)
    assert ("expired", "no_response_headers") in expiring.telemetry.stream_errors
    assert expiring.server.processor.response_watch.expired == 1
    # A response that comes after all is recorded, and the count stays right.
    for message in (response_headers(200), response_body(b"{}", end_of_stream=True)):
        await call.write(message)  # type: ignore[attr-defined]
        await call.read()  # type: ignore[attr-defined]
    assert pod.in_flight == 0


async def test_response_headers_in_time_keep_the_request_counted_to_its_end(
    expiring: Rig,
) -> None:
    pod = PODS[0]
    call: object = await routed(expiring)
    await call.write(response_headers(200))  # type: ignore[attr-defined]
    await call.read()  # type: ignore[attr-defined]
    await asyncio.sleep(0.5)  # a long generation after its headers
    assert pod.in_flight == 1
    assert len(expiring.server.processor.response_watch) == 0
    await call.write(response_body(b"{}", end_of_stream=True))  # type: ignore[attr-defined]
    await call.read()  # type: ignore[attr-defined]
    assert pod.in_flight == 0
    assert not [e for e in expiring.telemetry.stream_errors if e[0] == "expired"]


async def test_a_stream_that_ends_before_the_bound_is_forgotten(expiring: Rig) -> None:
    call: object = await routed(expiring)
    call.cancel()  # type: ignore[attr-defined]
    watch = expiring.server.processor.response_watch
    async with asyncio.timeout(30):  # the cancel reaches the server
        while len(watch) or PODS[0].in_flight:
            await asyncio.sleep(0.01)


async def test_expiry_zero_never_expires() -> None:
    rig = await Rig(ServingSettings(in_flight_expiry_seconds=0)).start()
    try:
        await routed(rig)
        await asyncio.sleep(0.3)
        assert PODS[0].in_flight == 1
        assert len(rig.server.processor.response_watch) == 0
    finally:
        await rig.stop()
