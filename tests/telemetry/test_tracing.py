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

from policyd.telemetry.tracing import DecisionSpan, DecisionTracer, FrozenAttributes


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
    tracer: DecisionTracer, parent: SpanContext | None, node_events: Sequence[FrozenAttributes] = ()
) -> None:
    span = tracer.start("chat m", parent, 100)
    tracer.finish(
        span,
        200,
        attribute_groups=[{"policyd.pod": "vllm-0"}],
        event_time=150,
        node_events=node_events,
        other_events=[],
        status=Status(StatusCode.OK),
    )


def test_a_span_joins_its_remote_parent_and_reaches_the_exporter() -> None:
    exporter = InMemorySpanExporter()
    tracer = DecisionTracer(processors=[SimpleSpanProcessor(exporter)])
    node = FrozenAttributes({"policyd.node.name": "has capacity", "policyd.node.kept": 3})
    finish(tracer, remote_parent(), [node])
    (span,) = exporter.get_finished_spans()
    assert span.context is not None and span.context.trace_id == 0xABC
    assert span.parent is not None and span.parent.span_id == 0xDEF and span.parent.is_remote
    assert span.context.trace_flags.sampled
    assert (span.start_time, span.end_time) == (100, 200)
    assert dict(span.attributes or {}) == {"policyd.pod": "vllm-0"}
    assert span.status.status_code is StatusCode.OK
    (event,) = span.events
    assert (event.name, event.timestamp, dict(event.attributes or {})) == (
        "policyd.node",
        150,
        {"policyd.node.name": "has capacity", "policyd.node.kept": 3},
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
        attribute_groups=[],
        event_time=150,
        node_events=[],
        other_events=[],
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


def test_frozen_attributes_read_like_a_mapping_and_cannot_be_changed() -> None:
    attributes = FrozenAttributes({"a": 1, "b": ("x", "y")})
    assert dict(attributes) == {"a": 1, "b": ("x", "y")} and len(attributes) == 2
    with pytest.raises(TypeError):
        attributes["a"] = 2  # type: ignore[index]


def test_a_decision_span_reads_as_the_readable_span_of_its_parts() -> None:
    """What SDK exporters read (properties, ``to_json``) is made from the parts."""
    shared = FrozenAttributes({"policyd.policy.name": "default", "policyd.outcome": "routed"})
    node = FrozenAttributes({"policyd.node.name": "has capacity"})
    shadow = Event("policyd.shadow", {"policyd.shadow.policy": "random"}, 150)
    collecting = Collecting()
    tracer = DecisionTracer(processors=[collecting], sampler=RecordOnly())
    tracer.finish(
        tracer.start("chat m", remote_parent(), 100),
        200,
        attribute_groups=[shared, {"policyd.pod": "vllm-0", "sampler.rule": "ours"}],
        event_time=150,
        node_events=[node, node],
        other_events=[shadow],
        status=Status(StatusCode.OK),
    )
    (span,) = collecting.spans
    assert isinstance(span, DecisionSpan)
    expected = ReadableSpan(
        "chat m",
        span.context,
        parent=span.parent,
        resource=tracer.resource,
        attributes={  # the sampler's first, giving way to policyd's own
            "policyd.policy.name": "default",
            "policyd.outcome": "routed",
            "policyd.pod": "vllm-0",
            "sampler.rule": "ours",
        },
        events=[
            Event("policyd.node", node, 150),
            Event("policyd.node", node, 150),
            shadow,
        ],
        status=Status(StatusCode.OK),
        start_time=100,
        end_time=200,
    )
    assert dict(span.attributes or {}) == dict(expected.attributes or {})
    assert [(e.name, e.timestamp, dict(e.attributes or {})) for e in span.events] == [
        (e.name, e.timestamp, dict(e.attributes or {})) for e in expected.events
    ]
    assert (span.dropped_attributes, span.dropped_events, span.links) == (0, 0, ())
    assert json.loads(span.to_json()) == json.loads(expected.to_json())


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


def test_a_decision_span_sets_every_field_a_readable_span_has() -> None:
    """DecisionSpan does not call ReadableSpan.__init__; an SDK whose spans gain a
    field its exporters read must fail here, not in the export thread."""
    collecting = Collecting()
    tracer = DecisionTracer(processors=[collecting])
    finish(tracer, None)
    (span,) = collecting.spans
    plain = ReadableSpan("chat m", span.context)
    assert set(vars(plain)) <= set(vars(span)) | {"_attributes", "_events"}
