"""Decision spans: the OpenTelemetry SDK's sampler, ids and processors, one span per decision.

A decision span is written once, by one owner, after the reply, from values
policyd bounds itself (``policyd.telemetry.attributes``). So the SDK's
``Span`` (a lock and a validation per attribute and event, made for spans
that many hands write while they run) is not used: the span is started here
(the sampler's decision and the ids, which the request's ``traceparent``
needs before the reply) and, when the response has ended, handed to every
processor as a plain SDK ``ReadableSpan`` built through its public
constructor. Exporting is the SDK's: ``BatchSpanProcessor`` and the stock
``OTLPSpanExporter`` (``policyd.telemetry.wiring``).

What users configure is the SDK's: the sampler (``OTEL_TRACES_SAMPLER``),
the resource (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``), the id
generator, and the processors with their exporters (``OTEL_BSP_*``,
``OTEL_EXPORTER_OTLP_*``). Not applied: the SDK's span limits
(``OTEL_SPAN_*_LIMIT``, ``OTEL_ATTRIBUTE_*``); the decision span bounds its
own lists and texts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import DEFAULT_ON, Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

log = logging.getLogger(__name__)

_NO_PARENT: Final = Context()  # what a sampler is given for a new root


@dataclass(slots=True)
class StartedSpan:
    """A span between start and finish: its ids, and whether anything records it.

    Only what the request's path needs (the ids and flags for its
    ``traceparent``) is made at the start; the SDK's ``SpanContext`` is made
    from them when the span is finished, after the reply.
    """

    name: str
    trace_id: int
    span_id: int
    flags: int  # the W3C trace flags as one int
    trace_state: TraceState | None
    parent: SpanContext | None
    start_ns: int
    recording: bool
    initial: Mapping[str, Any] | None  # the sampler's attributes, if it gave any

    @property
    def context(self) -> SpanContext:
        return SpanContext(
            self.trace_id,
            self.span_id,
            is_remote=False,
            trace_flags=TraceFlags(self.flags),
            trace_state=self.trace_state,
        )


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
        exporters: Sequence[SpanExporter] = (),
    ) -> None:
        self.processors = tuple(processors)
        self.exporters = tuple(exporters)  # what the processors export to, for the record
        self.resource = resource if resource is not None else Resource.create()
        self.sampler = sampler if sampler is not None else DEFAULT_ON  # the SDK's default
        self.scope = scope
        self.ids = id_generator if id_generator is not None else RandomIdGenerator()

    def start(self, name: str, parent: SpanContext | None, start_ns: int) -> StartedSpan:
        """Sample and identify a new span, as the SDK's ``Tracer.start_span`` does.

        ``parent`` is the remote parent's context, or ``None`` for a new root.
        """
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
            random_trace_id = parent.trace_flags & TraceFlags.RANDOM_TRACE_ID
        else:
            parent = None
            trace_id = self.ids.generate_trace_id()
            random_trace_id = self.ids.is_trace_id_random()
        initial: Mapping[str, Any] | None = None
        if self.sampler is DEFAULT_ON:
            # The SDK's default sampler (parent-based, always on), decided as it
            # decides but without making its result objects per span.
            recording = parent is None or parent.trace_flags.sampled
            flags = TraceFlags.SAMPLED if recording else TraceFlags.DEFAULT
            trace_state = None if parent is None else parent.trace_state
        else:
            context = _NO_PARENT
            if parent is not None:
                context = set_span_in_context(NonRecordingSpan(parent), _NO_PARENT)
            result = self.sampler.should_sample(context, trace_id, name, SpanKind.INTERNAL)
            recording = result.decision.is_recording()  # type: ignore[no-untyped-call]
            sampled = result.decision.is_sampled()  # type: ignore[no-untyped-call]
            flags = TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT
            trace_state = result.trace_state
            initial = result.attributes
        if random_trace_id:
            flags |= TraceFlags.RANDOM_TRACE_ID
        span_id = self.ids.generate_span_id()
        return StartedSpan(
            name, trace_id, span_id, flags, trace_state, parent, start_ns, recording, initial
        )

    def finish(
        self,
        span: StartedSpan,
        end_ns: int,
        *,
        attributes: Mapping[str, Any],
        events: Sequence[Event],
        status: Status,
    ) -> None:
        """Hand the finished span to every processor; a failing processor is logged.

        The sampler's attributes, if it gave any, come first and give way to
        policyd's own.
        """
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
            events=events,
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
