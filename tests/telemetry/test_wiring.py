"""build_telemetry and the OTEL_* environment; combine()."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from telemetry_support import pods, request

from policyd.policy.decision import Decision, Outcome
from policyd.telemetry import DecisionTracer, build_telemetry, combine, tracing_configured
from policyd.telemetry.exchange_end import ExchangeEnd

OTEL = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL:
        monkeypatch.delenv(name, raising=False)


def exporters(tracer: DecisionTracer | None) -> list[Any]:
    assert tracer is not None
    return list(tracer.exporters)


def test_unconfigured_tracing_stays_off_and_metrics_are_on() -> None:
    telemetry = build_telemetry()
    assert telemetry.tracer is None
    assert telemetry.metrics is not None
    assert telemetry.decision_log is None
    telemetry.shutdown()


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, False),
    ],
)
def test_when_tracing_counts_as_configured(environment: Mapping[str, str], expected: bool) -> None:
    assert tracing_configured(environment) is expected


def test_grpc_is_the_default_protocol_and_http_protobuf_is_supported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    telemetry = build_telemetry(otlp_endpoint="127.0.0.1:4317")
    (exporter,) = exporters(telemetry.tracer)
    assert isinstance(exporter, GrpcExporter)
    telemetry.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    telemetry = build_telemetry(otlp_endpoint="127.0.0.1:4318")
    (exporter,) = exporters(telemetry.tracer)
    assert isinstance(exporter, HttpExporter)
    assert exporter._endpoint == "http://127.0.0.1:4318/v1/traces"
    telemetry.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="'http/json' is not supported: use grpc or http/protobuf"):
        build_telemetry(otlp_endpoint="127.0.0.1:4318")


def test_several_exporters_and_unknown_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console,otlp")
    telemetry = build_telemetry()
    kinds = [type(e) for e in exporters(telemetry.tracer)]
    assert kinds == [ConsoleSpanExporter, GrpcExporter]
    telemetry.shutdown()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER=zipkin is not supported"):
        build_telemetry()


def test_the_service_name_defaults_to_policyd_and_the_environment_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging")
    tracer = build_telemetry().tracer
    assert tracer is not None
    assert tracer.resource.attributes["service.name"] == "policyd"
    assert tracer.resource.attributes["deployment.environment"] == "staging"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "policyd-eu")
    tracer = build_telemetry().tracer
    assert tracer is not None
    assert tracer.resource.attributes["service.name"] == "policyd-eu"


def test_the_sampler_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    telemetry = build_telemetry()
    decision = Decision(Outcome.ROUTED, "p", "1", "m", endpoint="10.0.0.1:8000", pod="a")
    record = telemetry.start(request(), decision, {}, 0.0)
    assert record._span is not None and not record._span.recording
    telemetry.shutdown()


def test_sdk_disabled_turns_tracing_off_even_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert build_telemetry(tracing=True, otlp_endpoint="127.0.0.1:4317").tracer is None


def test_a_decision_log_target_and_rate(tmp_path: Any) -> None:
    telemetry = build_telemetry(
        decision_log=str(tmp_path / "d.jsonl"), decision_log_sample_rate=0.5, metrics=False
    )
    assert telemetry.metrics is None
    assert telemetry.decision_log is not None and telemetry.decision_log.sample_rate == 0.5
    telemetry.shutdown()
    with pytest.raises(ValueError, match="sample rate"):
        build_telemetry(decision_log="-", decision_log_sample_rate=2)


class Feed:
    """A demo's own feed of decisions."""

    def __init__(self, fail: bool = False) -> None:
        self.events: list[str] = []
        self.fail = fail

    def start(self, request: Any, decision: Decision, carrier: Any, seconds: float) -> Feed:
        self.events.append(f"start {decision.pod}")
        return self

    @property
    def upstream_headers(self) -> Mapping[str, str]:
        return {"traceparent": "from-feed"}

    def after_reply(self, shadows: Any = None) -> None:
        self.events.append("after_reply")
        if self.fail:
            raise RuntimeError("feed bug")

    def response_headers(self, status: int, seconds_to_headers: float) -> None:
        self.events.append(f"status {status}")

    def end(self, end: ExchangeEnd) -> None:
        self.events.append(f"end {end.completed}")

    def stream_error(self, kind: str, code: str) -> None:
        self.events.append(f"error {kind}")


def test_combine_feeds_every_sink_and_isolates_failures() -> None:
    first, second = Feed(fail=True), Feed()
    both = combine(first, second)
    assert combine(first) is first
    decision = Decision(Outcome.ROUTED, "p", "1", "m", endpoint=pods()[0].address, pod="a")
    span = both.start(request(), decision, {}, 0.0)
    assert span.upstream_headers == {"traceparent": "from-feed"}
    span.after_reply()
    span.response_headers(200, 0.1)
    span.end(
        ExchangeEnd(
            completed=True,
            duration_seconds=1.0,
            first_body_seconds=None,
            prompt_tokens=None,
            completion_tokens=None,
        )
    )
    both.stream_error("aborted", "decided")
    expected = ["start a", "after_reply", "status 200", "end True", "error aborted"]
    assert first.events == expected and second.events == expected


def test_the_spans_scope_names_the_semantic_conventions_followed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    tracer = build_telemetry().tracer
    assert tracer is not None and tracer.scope is not None
    assert tracer.scope.name == "policyd"
    assert tracer.scope.schema_url == "https://opentelemetry.io/schemas/1.41.0"
