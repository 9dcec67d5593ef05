"""policyd's OTLP span encoder against the SDK's: the same message, field for field."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from policyd.telemetry.otlp_encoding import SpanEncoder
from policyd.telemetry.tracing import DecisionSpan, FrozenAttributes, StartedSpan

KEYS = st.sampled_from(["a", "b", "policyd.pod", "gen_ai.request.model", "ü.key", "x" * 130])
INT64 = st.integers(-(2**63), 2**63 - 1)
SCALARS = st.one_of(
    st.text(max_size=140),
    st.booleans(),
    INT64,
    st.integers(2**63, 2**70),  # does not fit: left out by both encoders
    st.floats(allow_nan=False),
    st.binary(max_size=20),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(st.text(max_size=10), max_size=5).map(tuple),
    st.lists(INT64, max_size=5),
    st.lists(st.floats(allow_nan=False), max_size=5).map(tuple),
    st.lists(st.booleans(), max_size=3),
)
ATTRIBUTES = st.dictionaries(KEYS, VALUES, max_size=6)

RESOURCES = [
    Resource({"service.name": "policyd", "host.name": "a"}),
    Resource({"service.name": "other"}, schema_url="https://opentelemetry.io/schemas/1.21.0"),
]
SCOPES: list[InstrumentationScope | None] = [
    None,
    InstrumentationScope("policyd", "1.2.3"),
    InstrumentationScope("lib", None, "https://example.com/schema", {"k": "v", "n": 3}),
]


def contexts(remote: bool | None = None) -> st.SearchStrategy[SpanContext]:
    return st.builds(
        SpanContext,
        trace_id=st.integers(1, 2**128 - 1),
        span_id=st.integers(1, 2**64 - 1),
        is_remote=st.booleans() if remote is None else st.just(remote),
        trace_flags=st.sampled_from([TraceFlags(0), TraceFlags(1), TraceFlags(3)]),
        trace_state=st.one_of(
            st.none(),
            st.just(TraceState([("vendor", "value"), ("other", "x")])),
            st.just(TraceState()),
        ),
    )


@st.composite
def events(draw: Any) -> Any:
    name = draw(st.sampled_from(["policyd.node", "policyd.shadow", ""]))
    timestamp = draw(st.integers(0, 2**63 - 1))
    attributes = draw(ATTRIBUTES)
    if draw(st.booleans()):  # shared, encoded once
        return Event(name, FrozenAttributes(attributes), timestamp)
    return Event(name, attributes, timestamp)


@st.composite
def spans(draw: Any) -> ReadableSpan:
    start = draw(st.integers(0, 2**63 - 1))
    return ReadableSpan(
        draw(st.text(max_size=30)),
        draw(contexts(remote=False)),
        parent=draw(st.one_of(st.none(), contexts())),
        resource=draw(st.sampled_from(RESOURCES)),
        attributes=draw(ATTRIBUTES),
        events=draw(st.lists(events(), max_size=4)),
        links=draw(st.lists(st.builds(Link, contexts(), ATTRIBUTES), max_size=2)),
        kind=draw(st.sampled_from(list(SpanKind))),
        status=draw(
            st.sampled_from(
                [Status(), Status(StatusCode.OK), Status(StatusCode.ERROR, "pod answered 503")]
            )
        ),
        start_time=start,
        end_time=draw(st.one_of(st.none(), st.integers(start, 2**63 - 1))),
        instrumentation_scope=draw(st.sampled_from(SCOPES)),
    )


@st.composite
def attribute_groups(draw: Any) -> list[Any]:
    """Groups with no key in two of them, each shared (frozen) or not."""
    merged = draw(st.dictionaries(KEYS, VALUES, max_size=6))
    keys = list(merged)
    cuts = sorted(draw(st.lists(st.integers(0, len(keys)), max_size=3)))
    groups: list[Any] = []
    for start, end in zip([0, *cuts], [*cuts, len(keys)], strict=True):
        group = {key: merged[key] for key in keys[start:end]}
        groups.append(FrozenAttributes(group) if draw(st.booleans()) else group)
    return groups


@st.composite
def decision_spans(draw: Any) -> DecisionSpan:
    start = draw(st.integers(0, 2**62))
    context = draw(contexts(remote=False))
    started = StartedSpan(
        name=draw(st.sampled_from(["text_completion adapter-3", "chat m", ""])),
        trace_id=context.trace_id,
        span_id=context.span_id,
        flags=context.trace_flags,
        trace_state=context.trace_state,
        parent=draw(st.one_of(st.none(), contexts())),
        start_ns=start,
        recording=True,
        initial=None,
    )
    return DecisionSpan(
        started,
        end_time=draw(st.integers(start, 2**63 - 1)),
        resource=draw(st.sampled_from(RESOURCES)),
        scope=draw(st.sampled_from(SCOPES)),
        status=draw(
            st.sampled_from([Status(), Status(StatusCode.ERROR, "the routing policy failed")])
        ),
        attribute_groups=draw(attribute_groups()),
        event_time=draw(st.integers(0, 2**63 - 1)),
        node_events=draw(st.lists(ATTRIBUTES.map(FrozenAttributes), max_size=4)),
        other_events=draw(st.lists(events(), max_size=2)),
    )


def decoded(data: bytes) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(data)


@settings(max_examples=200, deadline=None)
@given(st.lists(spans(), max_size=6))
def test_the_message_is_the_one_the_sdk_builds(batch: list[ReadableSpan]) -> None:
    encoder = SpanEncoder()
    expected = encode_spans(batch)
    assert decoded(encoder.encode(batch)) == expected
    assert decoded(encoder.encode(batch)) == expected  # again, through every cache


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(decision_spans(), spans()), max_size=6))
def test_decision_spans_written_from_their_parts_are_what_the_sdk_reads_of_them(
    batch: list[ReadableSpan],
) -> None:
    """The SDK's encoder reads a DecisionSpan's attributes and events as any
    ReadableSpan's; policyd's writes it from its groups and shared node events."""
    encoder = SpanEncoder()
    expected = encode_spans(batch)
    assert decoded(encoder.encode(batch)) == expected
    assert decoded(encoder.encode(batch)) == expected  # again, through every cache


def test_cached_pairs_keep_values_of_equal_hash_apart() -> None:
    """1, 1.0 and True are equal in Python, and one encoder sees them under one key."""
    context = SpanContext(1, 2, is_remote=False)
    batch = [
        ReadableSpan(
            "s", context, resource=RESOURCES[0], attributes={"v": value}, start_time=1, end_time=2
        )
        for value in (1, True, 1.0, "1", 1, True)
    ]
    encoder = SpanEncoder()
    assert decoded(encoder.encode(batch)) == encode_spans(batch)
    kinds = [
        span.attributes[0].value.WhichOneof("value")
        for span in decoded(encoder.encode(batch)).resource_spans[0].scope_spans[0].spans
    ]
    assert kinds == [
        "int_value",
        "bool_value",
        "double_value",
        "string_value",
        "int_value",
        "bool_value",
    ]


def test_a_key_under_two_fields_is_encoded_for_each() -> None:
    """The same key and value as a span attribute and as an event attribute."""
    context = SpanContext(1, 2, is_remote=False)
    span = ReadableSpan(
        "s",
        context,
        resource=RESOURCES[0],
        attributes={"policyd.pod": "vllm-1"},
        events=[Event("e", {"policyd.pod": "vllm-1"}, 5)],
        start_time=1,
        end_time=2,
    )
    encoded = decoded(SpanEncoder().encode([span, span]))
    (first, second) = encoded.resource_spans[0].scope_spans[0].spans
    assert first == second
    assert first.attributes[0].value.string_value == "vllm-1"
    assert first.events[0].attributes[0].value.string_value == "vllm-1"
