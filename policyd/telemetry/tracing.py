"""Decision spans made from the OpenTelemetry SDK's parts, without its ``Span`` class.

Why: the SDK's ``Span`` validates and locks on every attribute and event it
is given, and its OTLP encoder builds a protobuf object per value; for a
decision span (some 25 attributes and an event per filter node) that cost
several hundred microseconds per request in the serving process, more than
the decision and its serving path together (``benchmarks/overhead.py
--tracing``). A decision span is written once, by one owner, with attributes
whose types policyd controls and lists it bounds itself, so none of that
checking buys anything here.

What is kept of the SDK is what users configure: the sampler
(``OTEL_TRACES_SAMPLER``), the resource (``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_SERVICE_NAME``), the id generator and the span processors with their
exporters (``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_*``). A finished span is an
SDK ``ReadableSpan`` handed to each processor's ``on_end``, so every SDK
exporter works with it. Not applied: the SDK's span limits
(``OTEL_SPAN_*_LIMIT``, ``OTEL_ATTRIBUTE_*``); the decision span bounds its
own lists and texts (``policyd.telemetry.attributes``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import EventBase, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import DEFAULT_ON, Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, TraceFlags, get_current_span

log = logging.getLogger(__name__)


class FrozenAttributes(Mapping[str, Any]):
    """Attributes that never change, so their OTLP encoding is made once and kept.

    The node events of a reused filter-tree walk are the same for every
    request that shares it: ``policyd.telemetry.otlp_encoding`` stores its
    encoding of these on the object (``encoded``).
    """

    __slots__ = ("_items", "encoded")

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)
        # Encodings made of these by the OTLP encoder: the pairs under a field
        # tag (int), and a whole event but its time under the event's name (str).
        self.encoded: dict[int | str, bytes] = {}

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Any:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class FrozenEvent(EventBase):
    """A span event whose attributes are shared, frozen, between spans."""

    def __init__(self, name: str, attributes: FrozenAttributes, timestamp: int) -> None:
        super().__init__(name, timestamp)
        self._attributes = attributes

    @property
    def attributes(self) -> FrozenAttributes:
        return self._attributes

    @property
    def dropped_attributes(self) -> int:  # read by the SDK's encoders
        return 0


@dataclass(slots=True)
class StartedSpan:
    """A span between start and finish: its context, and whether anything records it."""

    name: str
    context: SpanContext
    parent: SpanContext | None
    start_ns: int
    recording: bool
    initial: Mapping[str, Any] | None  # the sampler's attributes, if it gave any


class DecisionTracer:
    """Starts decision spans (sampler, ids) and hands finished ones to the processors."""

    def __init__(
        self,
        *,
        processors: Sequence[SpanProcessor],
        resource: Resource | None = None,
        sampler: Sampler | None = None,
        scope: InstrumentationScope | None = None,
        id_generator: IdGenerator | None = None,
    ) -> None:
        self.processors = tuple(processors)
        self.resource = resource if resource is not None else Resource.create()
        self.sampler = sampler if sampler is not None else DEFAULT_ON  # the SDK's default
        self.scope = scope
        self.ids = id_generator if id_generator is not None else RandomIdGenerator()

    def start(self, name: str, parent: Context, start_ns: int) -> StartedSpan:
        """Sample and identify a new span, as the SDK's ``Tracer.start_span`` does."""
        parent_context: SpanContext | None = get_current_span(parent).get_span_context()
        if parent_context is not None and parent_context.is_valid:
            trace_id = parent_context.trace_id
            random_trace_id = parent_context.trace_flags.random_trace_id
        else:
            parent_context = None
            trace_id = self.ids.generate_trace_id()
            random_trace_id = self.ids.is_trace_id_random()
        result = self.sampler.should_sample(parent, trace_id, name, SpanKind.INTERNAL)
        sampled = result.decision.is_sampled()  # type: ignore[no-untyped-call]
        flags = TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT
        if random_trace_id:
            flags |= TraceFlags.RANDOM_TRACE_ID
        context = SpanContext(
            trace_id,
            self.ids.generate_span_id(),
            is_remote=False,
            trace_flags=TraceFlags(flags),
            trace_state=result.trace_state,
        )
        recording = result.decision.is_recording()  # type: ignore[no-untyped-call]
        return StartedSpan(name, context, parent_context, start_ns, recording, result.attributes)

    def finish(
        self,
        span: StartedSpan,
        end_ns: int,
        attributes: dict[str, Any],
        events: Sequence[EventBase],
        status: Status,
    ) -> None:
        """Hand the finished span to every processor; a failing processor is logged."""
        if not span.recording:
            return
        if span.initial:
            attributes = {**span.initial, **attributes}
        finished = ReadableSpan(
            span.name,
            span.context,
            parent=span.parent,
            resource=self.resource,
            attributes=attributes,
            events=events,  # type: ignore[arg-type]  # any EventBase: the SDK reads only that
            kind=SpanKind.INTERNAL,
            status=status,
            start_time=span.start_ns,
            end_time=end_ns,
            instrumentation_scope=self.scope,
        )
        for processor in self.processors:
            try:
                processor.on_end(finished)
            except Exception:
                log.exception("span processor %s failed", type(processor).__name__)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return all(processor.force_flush(timeout_millis) for processor in self.processors)

    def shutdown(self) -> None:
        for processor in self.processors:
            processor.shutdown()
