"""The test's collector: a real OTLP/gRPC trace receiver on loopback.

A ``grpc.aio`` server implementing ``opentelemetry.proto.collector.trace.v1
.TraceService`` (from the ``opentelemetry-proto`` package), the service an
OpenTelemetry Collector's OTLP receiver offers. Envoy's OpenTelemetry tracer
and policyd's OTLP exporter both send to it; it keeps every span it receives
with its service name.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    span: trace_pb2.Span

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def attributes(self) -> dict[str, Any]:
        return {kv.key: _value(kv.value) for kv in self.span.attributes}


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    return getattr(any_value, kind) if kind else None


class OtlpCollector(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.port = 0
        self._server: grpc.aio.Server | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)

    async def Export(  # noqa: N802 (the gRPC method name)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            service = next(
                (
                    kv.value.string_value
                    for kv in resource_spans.resource.attributes
                    if kv.key == "service.name"
                ),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(ReceivedSpan(service, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of(self, service: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.service == service]

    async def wait_for(self, service: str, count: int = 1, timeout: float = 30.0) -> None:
        for _ in range(int(timeout / 0.05)):
            if len(self.of(service)) >= count:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{service} sent {len(self.of(service))} spans, expected {count}")
