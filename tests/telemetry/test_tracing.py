"""DecisionTracer: the SDK's sampler, ids and processors around policyd's own span."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
)
from opentelemetry.trace import (
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.trace.span import TraceState

from policyd.telemetry.tracing import DecisionTracer


class RecordOnly(Sampler):
    """Records without sampling, adds an attribute and a tracestate entry."""

    def should_sample(self, parent_context: Any, trace_id: int, *args: Any, **kw: Any) -> Any:
        return SamplingResult(
            Decision.RECORD_ONLY, {"sampler.rule": "canary"}, TraceState([("policyd", "r1")])
        )

    def get_description(self) -> str:
        return "RecordOnly"


class Exploding(SpanProcessor):
    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("processor down")


class Collecting(SpanProcessor):
    """Sees every span handed to processors, sampled or not (the SDK's own drop them)."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def remote_parent(flags: int = 1) -> SpanContext:
    return SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(flags))


def finish(
    tracer: DecisionTracer, parent: SpanContext | None, events: Sequence[Event] = ()
) -> None:
    span = tracer.start("chat m", parent, 100)
    tracer.finish(
        span,
        200,
        attributes={"policyd.pod": "vllm-0"},
        events=events,
        status=Status(StatusCode.OK),
    )


def test_a_span_joins_its_remote_parent_and_reaches_the_exporter() -> None:
    exporter = InMemorySpanExporter()
    tracer = DecisionTracer(processors=[SimpleSpanProcessor(exporter)])
    shadow = Event("policyd.shadow", {"policyd.shadow.policy": "random"}, 150)
    finish(tracer, remote_parent(), [shadow])
    (span,) = exporter.get_finished_spans()
    assert span.context is not None and span.context.trace_id == 0xABC
    assert span.parent is not None and span.parent.span_id == 0xDEF and span.parent.is_remote
    assert span.context.trace_flags.sampled
    assert (span.start_time, span.end_time) == (100, 200)
    assert dict(span.attributes or {}) == {"policyd.pod": "vllm-0"}
    assert span.status.status_code is StatusCode.OK
    (event,) = span.events
    assert (event.name, event.timestamp, dict(event.attributes or {})) == (
        "policyd.shadow",
        150,
        {"policyd.shadow.policy": "random"},
    )


def test_parent_based_sampling_follows_an_unsampled_parent() -> None:
    collecting = Collecting()
    tracer = DecisionTracer(processors=[collecting])
    span = tracer.start("chat m", remote_parent(flags=0), 100)
    assert not span.recording and not span.context.trace_flags.sampled
    assert span.context.trace_id == 0xABC  # the context still goes upstream
    tracer.finish(
        span,
        200,
        attributes={},
        events=[],
        status=Status(),
    )
    assert collecting.spans == []


def test_the_samplers_attributes_and_tracestate_are_kept() -> None:
    collecting = Collecting()
    tracer = DecisionTracer(processors=[collecting], sampler=RecordOnly())
    finish(tracer, None)
    (span,) = collecting.spans
    assert span.context is not None and not span.context.trace_flags.sampled
    assert span.context.trace_state.get("policyd") == "r1"
    assert span.parent is None
    assert dict(span.attributes or {}) == {"sampler.rule": "canary", "policyd.pod": "vllm-0"}


def test_a_failing_processor_is_logged_and_the_next_still_gets_the_span(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exporter = InMemorySpanExporter()
    tracer = DecisionTracer(processors=[Exploding(), SimpleSpanProcessor(exporter)])
    finish(tracer, None)
    assert len(exporter.get_finished_spans()) == 1
    assert "span processor Exploding failed" in caplog.text


def test_a_finished_span_is_a_plain_readable_span_the_sdk_exports() -> None:
    """Built through ReadableSpan's public constructor; the SDK's own encoder reads it."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
        encode_spans,
    )

    collecting = Collecting()
    tracer = DecisionTracer(processors=[collecting], sampler=RecordOnly())
    shadow = Event("policyd.shadow", {"policyd.shadow.policy": "random"}, 150)
    finish(tracer, remote_parent(), [shadow])
    (span,) = collecting.spans
    assert type(span) is ReadableSpan
    # The sampler's attributes first, giving way to policyd's own.
    assert dict(span.attributes or {}) == {"sampler.rule": "canary", "policyd.pod": "vllm-0"}
    assert json.loads(span.to_json())["events"][0]["name"] == "policyd.shadow"
    (resource_spans,) = encode_spans([span]).resource_spans
    (encoded,) = resource_spans.scope_spans[0].spans
    assert encoded.name == "chat m" and len(encoded.attributes) == 2


@pytest.mark.parametrize(
    "parent",
    [
        None,
        remote_parent(flags=1),
        remote_parent(flags=0),
        SpanContext(0xABC, 0xDEF, False, TraceFlags(1), TraceState([("vendor", "v")])),
        SpanContext(0xABC, 0xDEF, True, TraceFlags(0), TraceState([("a", "b")])),
    ],
)
def test_the_default_sampler_decides_as_the_sdks_own(parent: SpanContext | None) -> None:
    """DEFAULT_ON is decided without calling it; any other instance is called."""
    fast = DecisionTracer(processors=[]).start("chat m", parent, 100)
    called = DecisionTracer(processors=[], sampler=ParentBased(ALWAYS_ON)).start(
        "chat m", parent, 100
    )
    assert fast.recording == called.recording
    assert dict(fast.initial or {}) == dict(called.initial or {}) == {}
    assert fast.context.trace_flags == called.context.trace_flags
    assert fast.context.trace_state == called.context.trace_state
    assert fast.parent == called.parent
