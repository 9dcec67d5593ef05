"""Speaking ext_proc to policyd the way Envoy does, over a real in-process gRPC channel.

:class:`EnvoySide` opens one ``Process`` stream per HTTP request and sends the
same messages Envoy 1.40 sends (``raw_value`` header values, ``protocol_config``
on the first message); the builders below make those messages.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from policyd.extproc.grpc_server import ExtProcServer
from policyd.policy.decision import Decision, Outcome
from policyd.policy.request import Request
from policyd.pool.pod import Pod
from policyd.telemetry.exchange_end import ExchangeEnd

Mode = processing_mode_pb2.ProcessingMode.BodySendMode


def header_map(headers: Mapping[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )


def request_headers(
    extra: Mapping[str, str] | None = None,
    *,
    path: str = "/v1/completions",
    end_of_stream: bool = False,
    body_mode: int | None = Mode.BUFFERED,
) -> pb.ProcessingRequest:
    headers = {
        ":method": "POST",
        ":path": path,
        ":authority": "gateway",
        "content-type": "application/json",
        "x-request-id": "req-1",
        **(extra or {}),
    }
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream)
    )
    if body_mode is not None:
        message.protocol_config.request_body_mode = body_mode
        message.protocol_config.response_body_mode = Mode.STREAMED
    return message


def request_body(document: Any, *, end_of_stream: bool = True) -> pb.ProcessingRequest:
    raw = document if isinstance(document, bytes) else json.dumps(document).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=end_of_stream))


def response_headers(
    status: int = 200, content_type: str = "application/json", *, end_of_stream: bool = False
) -> pb.ProcessingRequest:
    headers = {":status": str(status), "content-type": content_type}
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream)
    )


def response_body(chunk: bytes, *, end_of_stream: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def set_headers(reply: pb.ProcessingResponse) -> dict[str, base_pb2.HeaderValueOption]:
    common = getattr(reply, reply.WhichOneof("response")).response
    return {option.header.key: option for option in common.header_mutation.set_headers}


def error_of(reply: pb.ProcessingResponse) -> tuple[int, dict[str, Any]]:
    assert reply.WhichOneof("response") == "immediate_response", reply
    immediate = reply.immediate_response
    return immediate.status.code, json.loads(immediate.body)["error"]


async def settled(server: ExtProcServer) -> None:
    """Wait for the requests' bookkeeping (spans, metrics) to run: the server
    settles it a few milliseconds after the replies (``settlement.py``)."""
    settlement = server.processor.settlement
    for _ in range(6000):
        await asyncio.sleep(0.005)
        if settlement.idle:
            return
    raise AssertionError("the server's settlement did not run within 30 s")


@dataclass(frozen=True)
class Snapshot:
    """A fixed pool snapshot: what the server reads ``candidates`` from."""

    candidates: tuple[Pod, ...]


class EnvoySide:
    """A gRPC client playing Envoy's part of the ext_proc protocol."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    def open(self, metadata: Sequence[tuple[str, str]] = ()) -> Any:
        """One stream (one HTTP request); ``call.write`` then ``call.read`` per phase."""
        return self.stub.Process(metadata=tuple(metadata))

    async def exchange(self, *messages: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """Send the messages in order, reading the reply to each; then close.

        The response's last message gets no reply: policyd ends the stream with
        status OK instead (process_stream.py), so the replies stop there."""
        call = self.open()
        replies = []
        for message in messages:
            await call.write(message)
            reply = await call.read()
            if reply is grpc.aio.EOF:
                assert await call.code() == grpc.StatusCode.OK
                break
            replies.append(reply)
        await call.done_writing()
        return replies

    async def close(self) -> None:
        await self.channel.close()


class PickFirst:
    """A router test double: routes to the first candidate, or as scripted."""

    def __init__(self, decision: Decision | None = None, error: Exception | None = None) -> None:
        self.decision = decision
        self.error = error
        self.seen: list[Request] = []

    def decide(self, request: Request, candidates: Sequence[Pod], prompt: Any = None) -> Decision:
        self.seen.append(request)
        if self.error is not None:
            raise self.error
        if self.decision is not None:
            return self.decision
        pod = candidates[0]
        return Decision(
            Outcome.ROUTED,
            "test",
            "1",
            request.model,
            endpoint=pod.address,
            pod=pod.name,
            fallbacks=tuple(p.address for p in candidates[1:]),
        )


class Span:
    """A telemetry test double's span: remembers every call."""

    def __init__(self, carrier: Mapping[str, str], fail_on: str = "") -> None:
        self.carrier = dict(carrier)
        self.fail_on = fail_on
        self.statuses: list[int] = []
        self.ends: list[dict[str, Any]] = []
        self.after_replies = 0

    @property
    def upstream_headers(self) -> Mapping[str, str]:
        if self.fail_on == "upstream_headers":
            raise RuntimeError("telemetry bug")
        return {"traceparent": "00-11111111111111111111111111111111-2222222222222222-01"}

    def after_reply(self, shadows: Any = None) -> None:
        self.after_replies += 1
        if self.fail_on == "after_reply":
            raise RuntimeError("telemetry bug")

    def response_headers(self, status: int, seconds_to_headers: float) -> None:
        self.statuses.append(status)
        if self.fail_on == "response_headers":
            raise RuntimeError("telemetry bug")

    def end(self, end: ExchangeEnd) -> None:
        self.ends.append(end._asdict())
        if self.fail_on == "end":
            raise RuntimeError("telemetry bug")


class RecordingTelemetry:
    """A telemetry test double; ``fail_on`` names a hook that raises."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.decisions: list[Decision] = []
        self.stream_errors: list[tuple[str, str]] = []
        self.fail_on = ""

    def start(
        self,
        request: Request,
        decision: Decision,
        trace_carrier: Mapping[str, str],
        decision_seconds: float,
    ) -> Span:
        if self.fail_on == "start":
            raise RuntimeError("telemetry bug")
        assert decision_seconds >= 0
        self.decisions.append(decision)
        span = Span(trace_carrier, self.fail_on)
        self.spans.append(span)
        return span

    def stream_error(self, kind: str, code: str) -> None:
        self.stream_errors.append((kind, code))
        if self.fail_on == "stream_error":
            raise RuntimeError("telemetry bug")
