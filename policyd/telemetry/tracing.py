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
exporter works with it. That span is a ``DecisionSpan``: its attributes come
in groups, the groups shared by many requests (policy, model, pod) made once
and kept, and its node events are the shared attributes of the filter-tree
steps; policyd's OTLP/gRPC encoder writes it straight from those parts, and
the dict of attributes and the list of events the SDK's exporters read are
made only when one reads them. Not applied: the SDK's span limits
(``OTEL_SPAN_*_LIMIT``, ``OTEL_ATTRIBUTE_*``); the decision span bounds its
own lists and texts (``policyd.telemetry.attributes``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
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

from policyd.telemetry.attributes import NODE_EVENT

log = logging.getLogger(__name__)

_NO_PARENT: Final = Context()  # what a sampler is given for a new root


class FrozenAttributes(Mapping[str, Any]):
    """Attributes that never change, so their OTLP encoding is made once and kept.

    The node events of a reused filter-tree walk are the same for every
    request that shares it: ``policyd.telemetry.otlp_encoding`` stores its
    encodings of these on the object (``encoded``, ``encoded_event``).
    """

    __slots__ = ("_items", "encoded", "encoded_event")

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)
        # Encodings made of these by the OTLP encoder: the pairs under a field
        # tag, and a timed node event as the bytes before its time and after it.
        self.encoded: dict[int, bytes] = {}
        self.encoded_event: tuple[bytes, bytes] | None = None

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Any:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class DecisionSpan(ReadableSpan):
    """A finished decision span: a ``ReadableSpan`` made of shareable parts.

    - ``attribute_groups``: the span's attributes, group after group, no key
      in two groups; a ``FrozenAttributes`` group is shared by many spans and
      encoded once.
    - ``node_events``: one event per filter-tree step, all named
      ``NODE_EVENT`` and timed ``event_time``, each the step's shared
      attributes; then ``other_events``.

    ``ReadableSpan.__init__`` is not called because ``_attributes`` and
    ``_events``, which its properties and ``to_json`` read, are made here from
    those parts on first use; the other fields are set as it sets them.
    """

    def __init__(
        self,
        span: StartedSpan,
        *,
        end_time: int,
        resource: Resource,
        scope: InstrumentationScope | None,
        status: Status,
        attribute_groups: Sequence[Mapping[str, Any]],
        event_time: int,
        node_events: Sequence[FrozenAttributes],
        other_events: Sequence[Event],
    ) -> None:
        self._name = span.name
        self._context = span.context
        self._kind = SpanKind.INTERNAL
        self._instrumentation_info = None
        self._instrumentation_scope = scope
        self._parent = span.parent
        self._start_time = span.start_ns
        self._end_time = end_time
        self._links = ()
        self._resource = resource
        self._status = status
        self.attribute_groups = attribute_groups
        self.event_time = event_time
        self.node_events = node_events
        self.other_events = other_events
        self._merged: dict[str, Any] | None = None

    @property
    def _attributes(self) -> dict[str, Any]:  # type: ignore[override]  # made from the groups
        merged = self._merged
        if merged is None:
            merged = {}
            for group in self.attribute_groups:
                merged.update(group)
            self._merged = merged
        return merged

    @property
    def _events(self) -> Sequence[Event]:  # type: ignore[override]  # made from the parts
        at = self.event_time
        events = [Event(NODE_EVENT, node, at) for node in self.node_events]
        events.extend(self.other_events)
        return events


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
    ) -> None:
        self.processors = tuple(processors)
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
        attribute_groups: Sequence[Mapping[str, Any]],
        event_time: int,
        node_events: Sequence[FrozenAttributes],
        other_events: Sequence[Event],
        status: Status,
    ) -> None:
        """Hand the finished span to every processor; a failing processor is logged.

        ``attribute_groups`` must not share keys (the sampler's attributes,
        put first, give way to policyd's own).
        """
        if not span.recording:
            return
        if span.initial:
            ours = {key for group in attribute_groups for key in group}
            initial = {key: value for key, value in span.initial.items() if key not in ours}
            attribute_groups = (initial, *attribute_groups)
        finished = DecisionSpan(
            span,
            end_time=end_ns,
            resource=self.resource,
            scope=self.scope,
            status=status,
            attribute_groups=attribute_groups,
            event_time=event_time,
            node_events=node_events,
            other_events=other_events,
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
