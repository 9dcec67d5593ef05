"""The OTLP/gRPC span exporter with policyd's encoder (``otlp_encoding``).

The SDK's exporter keeps everything users configure (endpoint, headers, TLS,
compression, timeout, retries and reconnection from ``OTEL_EXPORTER_OTLP_*``);
two of its parts are replaced: the translation step, which the exporter mixin
leaves to each signal, returns the request already encoded, and the stub it
calls sends those bytes as they are instead of serializing a message (the
mixin builds its client from ``_stub`` on every connection and reconnection).
``tests/telemetry/test_trace_e2e.py`` exports through this class to a real
OTLP receiver, which catches an SDK that changes these parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import ReadableSpan

from policyd.telemetry.otlp_encoding import SpanEncoder

EXPORT_METHOD: Final = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class EncodedTraceServiceStub:
    """``TraceServiceStub`` whose ``Export`` takes an encoded request (bytes)."""

    def __init__(self, channel: grpc.Channel) -> None:
        # No request serializer: gRPC sends bytes as given.
        self.Export = channel.unary_unary(
            EXPORT_METHOD,
            response_deserializer=ExportTraceServiceResponse.FromString,
        )


class GrpcSpanExporter(OTLPSpanExporter):
    """``OTLPSpanExporter`` encoding spans with ``SpanEncoder``."""

    def __init__(self, **options: Any) -> None:
        self._encoder = SpanEncoder()
        super().__init__(**options)

    def _initialize_channel_and_stub(self) -> None:
        self._stub = EncodedTraceServiceStub  # what the mixin builds its client from
        super()._initialize_channel_and_stub()  # type: ignore[no-untyped-call]

    def _translate_data(self, data: Sequence[ReadableSpan]) -> bytes:  # type: ignore[override]
        return self._encoder.encode(data)
