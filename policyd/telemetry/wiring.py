"""Wiring policyd's telemetry from flags and the standard ``OTEL_*`` variables.

``build_telemetry`` is what ``policyd serve`` calls. Tracing follows the
OpenTelemetry SDK's environment variables:

- on when ``otlp_endpoint`` is given, or an exporter is configured
  (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
  ``OTEL_TRACES_EXPORTER``); off with ``OTEL_SDK_DISABLED=true`` or
  ``OTEL_TRACES_EXPORTER=none``. Unconfigured, it stays off rather than
  retrying a collector on localhost forever;
- ``OTEL_TRACES_EXPORTER``: ``otlp`` (default), ``console``, ``none``;
- ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``: ``grpc`` (default) or
  ``http/protobuf``; endpoint, headers, TLS, timeout and compression from the
  exporter's own ``OTEL_EXPORTER_OTLP_*`` variables;
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default
  ``parentbased_always_on``: Envoy's sampling decision is kept);
- ``OTEL_SERVICE_NAME`` (default ``policyd``) and ``OTEL_RESOURCE_ATTRIBUTES``;
- ``OTEL_BSP_*`` for the batch span processor, which exports on its own thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry

from policyd import __version__
from policyd.telemetry.attributes import SCHEMA_URL
from policyd.telemetry.decision_log import DecisionLog
from policyd.telemetry.metrics import DecisionMetrics
from policyd.telemetry.record import DecisionTelemetry
from policyd.telemetry.tracing import DecisionTracer

DEFAULT_SERVICE_NAME: Final = "policyd"
INSTRUMENTATION_NAME: Final = "policyd"
_TRUE: Final = ("true", "1", "yes")


def build_telemetry(
    *,
    tracing: bool | None = None,
    otlp_endpoint: str = "",
    metrics: bool = True,
    registry: CollectorRegistry | None = None,
    decision_log: str = "",
    decision_log_sample_rate: float = 1.0,
    span_usage: bool = True,
    worker: int = 0,
) -> DecisionTelemetry:
    """policyd's telemetry: spans (see the module docstring), metrics, decision log.

    ``tracing`` None means "as configured"; ``otlp_endpoint`` (``host:port``
    or a URL) overrides the environment's endpoint. ``decision_log`` is
    ``-`` (standard output), a file path, or empty for none. ``span_usage``:
    see ``DecisionTelemetry``; ``worker``: the process's index among
    ``--workers`` (``policyd_build_info``). Raises
    ``ValueError`` for a setting that cannot work (an unknown exporter or
    protocol, a sample rate outside [0, 1], a log file that cannot be opened).
    """
    environ = os.environ
    enabled = tracing if tracing is not None else bool(otlp_endpoint) or tracing_configured(environ)
    tracer = None
    if enabled and not _flag(environ, "OTEL_SDK_DISABLED"):
        tracer = tracer_from_env(otlp_endpoint=otlp_endpoint)
    log = (
        DecisionLog.open(decision_log, sample_rate=decision_log_sample_rate)
        if decision_log
        else None
    )
    return DecisionTelemetry(
        tracer=tracer,
        metrics=DecisionMetrics(registry, worker=worker) if metrics else None,
        decision_log=log,
        span_usage=span_usage,
    )


def tracing_configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces to be exported somewhere."""
    if _flag(environ, "OTEL_SDK_DISABLED"):
        return False
    exporters = _exporters(environ)
    if exporters == ["none"]:
        return False
    return bool(
        environ.get("OTEL_TRACES_EXPORTER")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def tracer_from_env(*, otlp_endpoint: str = "") -> DecisionTracer:
    """A decision tracer with a batch processor per configured exporter (``os.environ``)."""
    environ = os.environ
    resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    # The sampler as the SDK's provider reads it from OTEL_TRACES_SAMPLER(_ARG).
    sampler = TracerProvider(resource=resource, shutdown_on_exit=False).sampler
    exporters = [
        _exporter(name, otlp_endpoint, environ) for name in _exporters(environ) if name != "none"
    ]
    return DecisionTracer(
        processors=[BatchSpanProcessor(exporter) for exporter in exporters],
        exporters=exporters,
        resource=resource,
        sampler=sampler,
        scope=InstrumentationScope(INSTRUMENTATION_NAME, __version__, SCHEMA_URL),
    )


def _exporters(environ: Mapping[str, str]) -> list[str]:
    names = environ.get("OTEL_TRACES_EXPORTER", "otlp")
    return [name.strip().lower() for name in names.split(",") if name.strip()] or ["otlp"]


def _exporter(name: str, endpoint: str, environ: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={name} is not supported: use otlp, console or none")
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    base = endpoint if "://" in endpoint or not endpoint else f"http://{endpoint}"
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter as GrpcExporter,
            )

            return GrpcExporter(endpoint=base) if base else GrpcExporter()
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter as HttpExporter,
            )

            traces = f"{base.rstrip('/')}/v1/traces"
            return HttpExporter(endpoint=traces) if base else HttpExporter()
    except ImportError as error:  # xds-protos' old copy of the OTLP protos won the install
        raise ValueError(
            f"the OTLP exporter cannot load ({error}): xds-protos overwrote opentelemetry-proto's "
            "files; run `pip install --force-reinstall --no-deps opentelemetry-proto`"
        ) from error
    raise ValueError(f"OTLP protocol {protocol!r} is not supported: use grpc or http/protobuf")


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in _TRUE
