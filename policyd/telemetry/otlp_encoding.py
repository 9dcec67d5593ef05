"""Finished spans to OTLP ``ExportTraceServiceRequest`` bytes, written directly.

Why not the exporter's own encoder: it builds a protobuf object for every
attribute value, key-value pair, event and span, about 8 us per attribute
here; a decision span carries some 65 (attributes plus node events), so
encoding cost ~530 us per span, several times the decision itself, on the
batch thread of the serving process. Writing the protobuf wire format
directly, with the encoded attribute keys, recurring pairs, resources, scopes
and shared node events (``FrozenAttributes``) cached, costs a fifth of that
when nothing is shared and about a tenth when walks are reused
(``benchmarks/telemetry.py``). A ``DecisionSpan`` is written from its parts:
its shared attribute groups and node events come from their caches whole.

The output is the same message the SDK's ``encode_spans`` builds, field for
field (``tests/telemetry/test_otlp_encoding.py`` parses both and compares);
field numbers are those of ``opentelemetry/proto/trace/v1/trace.proto`` and
``common/v1/common.proto``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, SpanKind, Status, TraceState

from policyd.telemetry.attributes import NODE_EVENT
from policyd.telemetry.identity_cache import IdentityCache
from policyd.telemetry.tracing import DecisionSpan, FrozenAttributes

_FIXED64: Final = struct.Struct("<Q").pack
_FIXED32: Final = struct.Struct("<I").pack
_DOUBLE: Final = struct.Struct("<d").pack

# Span.flags: the context-has-is-remote bit, plus is-remote for a remote parent.
_HAS_IS_REMOTE: Final = 0x100
_IS_REMOTE: Final = 0x200

_SPAN_KINDS: Final = {  # SpanKind to Span.SpanKind (0 is unspecified)
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}

_CACHE_LIMIT: Final = 4096  # entries per cache: keys come from code, values may not
_BYTES: Final = [bytes((i,)) for i in range(0x100)]  # tags, and varints under 0x80


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _BYTES[value]
    if value < 0x4000:  # most lengths here: two bytes, without the loop
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (``tag`` of one byte): tag, length, payload."""
    size = len(payload)
    return _BYTES[tag] + (_BYTES[size] if size < 0x80 else _varint(size)) + payload


_NODE_EVENT_NAME: Final = _field(0x12, NODE_EVENT.encode())  # Span.Event.name


def _int64(value: int) -> int:
    """An int64 as protobuf writes it in a varint: negatives as 64-bit two's complement."""
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{value} does not fit an int64 attribute")
    return value & 0xFFFFFFFFFFFFFFFF


class SpanEncoder:
    """Encodes batches of finished spans; one per exporter (its caches are not shared).

    Not thread-safe by design: the batch processor calls its exporter from one
    thread at a time.
    """

    def __init__(self) -> None:
        self._keys: dict[int, dict[str, _Key]] = {}  # by field tag, then key
        self._names: dict[str, bytes] = {}  # event names, encoded
        self._span_names: dict[str, bytes] = {}  # decision span names, as field 5
        # Resources and scopes by identity (a Resource hashes through JSON).
        self._resources: IdentityCache[Any, bytes] = IdentityCache(_CACHE_LIMIT)
        self._scopes: IdentityCache[Any, bytes] = IdentityCache(_CACHE_LIMIT)

    def encode(self, spans: Sequence[ReadableSpan]) -> bytes:
        """The ``ExportTraceServiceRequest`` for ``spans``, grouped by resource and scope.

        Spans are grouped by the identity of their resource and scope objects (the
        SDK's encoder groups equal ones): a tracer gives all its spans the same two.
        """
        grouped: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
        for span in spans:
            resource = span.resource
            scope = span.instrumentation_scope or None
            by_scope = grouped.get(id(resource))
            if by_scope is None:
                by_scope = grouped[id(resource)] = (resource, {})
            in_scope = by_scope[1].get(id(scope))
            if in_scope is None:
                in_scope = by_scope[1][id(scope)] = (scope, [])
            in_scope[1].append(self._entry(span))
        parts: list[bytes] = []
        for resource, scopes in grouped.values():
            self._resource_spans(resource, scopes.values(), parts)
        return b"".join(parts)  # the spans' bytes are copied once, here

    def _entry(self, span: ReadableSpan) -> bytes:
        """One entry of ``ScopeSpans.spans``."""
        body = self._decision_span(span) if type(span) is DecisionSpan else self._span(span)
        return _BYTES[0x12] + _varint(len(body)) + body

    # -- the parts -------------------------------------------------------------------------

    def _resource_spans(
        self, resource: Any, scopes: Iterable[tuple[Any, list[bytes]]], parts: list[bytes]
    ) -> None:
        """Appends ``ExportTraceServiceRequest.resource_spans`` (field 1) for one
        resource to ``parts``: each message's head, then what it holds."""
        body = [self._resource(resource)]
        for scope, encoded in scopes:
            head = self._scope(scope)
            tail = b""
            if scope is not None and scope.schema_url:
                tail = _field(0x1A, scope.schema_url.encode())
            size = len(head) + sum(map(len, encoded)) + len(tail)
            body += (_BYTES[0x12] + _varint(size), head, *encoded, tail)
        if resource.schema_url:
            body.append(_field(0x1A, resource.schema_url.encode()))
        parts.append(_BYTES[0x0A] + _varint(sum(map(len, body))))
        parts += body

    def _resource(self, resource: Any) -> bytes:
        """ResourceSpans.resource (field 1), cached: a tracer has one resource."""
        known = self._resources.get(resource)
        if known is not None:
            return known
        return self._resources.keep(
            resource, _field(0x0A, self._attributes(0x0A, resource.attributes))
        )

    def _scope(self, scope: Any) -> bytes:
        """ScopeSpans.scope (field 1), cached per instrumentation scope."""
        known = self._scopes.get(scope)
        if known is not None:
            return known
        body = b""
        if scope is not None:
            if scope.name:
                body += _field(0x0A, scope.name.encode())
            if scope.version:
                body += _field(0x12, scope.version.encode())
            body += self._attributes(0x1A, scope.attributes)
        return self._scopes.keep(scope, _field(0x0A, body))

    def _span(self, span: ReadableSpan) -> bytearray:
        context = span.get_span_context()
        assert context is not None  # a finished SDK span always has one
        parent = span.parent
        out = bytearray(b"\x0a\x10")  # trace_id, 16 bytes
        out += context.trace_id.to_bytes(16, "big")
        out += b"\x12\x08"  # span_id, 8 bytes
        out += context.span_id.to_bytes(8, "big")
        trace_state = _trace_state(context.trace_state)
        if trace_state:
            out += _field(0x1A, trace_state.encode())
        if parent is not None:
            out += b"\x22\x08"  # parent_span_id
            out += parent.span_id.to_bytes(8, "big")
        if span.name:
            out += _field(0x2A, span.name.encode())
        out += b"\x30"  # kind
        out += _varint(_SPAN_KINDS[span.kind])
        if span.start_time:
            out += b"\x39"  # start_time_unix_nano, fixed64
            out += _FIXED64(span.start_time)
        if span.end_time:
            out += b"\x41"  # end_time_unix_nano, fixed64
            out += _FIXED64(span.end_time)
        out += self._attributes(0x4A, span.attributes)
        if span.dropped_attributes:
            out += b"\x50" + _varint(span.dropped_attributes)
        for event in span.events:
            out += _field(0x5A, self._event(event))
        if span.dropped_events:
            out += b"\x60" + _varint(span.dropped_events)
        for link in span.links:
            out += _field(0x6A, self._link(link))
        if span.dropped_links:
            out += b"\x70" + _varint(span.dropped_links)
        if span.status is not None:
            out += _status(span.status)
        out += b"\x85\x01"  # flags (field 16), fixed32
        out += _FIXED32(_flags(parent))
        return out

    def _decision_span(self, span: DecisionSpan) -> bytearray:
        """``_span``'s bytes for a decision span, written from its parts.

        What ``_span`` would read of it and find empty or fixed (links, dropped
        counts, kind) is not asked for; the shared attribute groups and node
        events come encoded from their caches.
        """
        context = span.context
        parent = span.parent
        out = bytearray(b"\x0a\x10")  # trace_id
        out += context.trace_id.to_bytes(16, "big")
        out += b"\x12\x08"  # span_id
        out += context.span_id.to_bytes(8, "big")
        if context.trace_state:
            out += _field(0x1A, _trace_state(context.trace_state).encode())
        if parent is not None:
            out += b"\x22\x08"  # parent_span_id
            out += parent.span_id.to_bytes(8, "big")
        name = self._span_names.get(span.name)
        if name is None:
            name = _field(0x2A, span.name.encode()) if span.name else b""
            if len(self._span_names) >= _CACHE_LIMIT:
                self._span_names.clear()
            self._span_names[span.name] = name
        out += name
        out += b"\x30\x01"  # kind: internal
        if span.start_time:
            out += b"\x39"
            out += _FIXED64(span.start_time)
        if span.end_time:
            out += b"\x41"
            out += _FIXED64(span.end_time)
        for group in span.attribute_groups:
            out += self._attributes(0x4A, group)
        if span.node_events:
            at = span.event_time
            if at:
                timestamp = _FIXED64(at)
                for attributes in span.node_events:
                    parts = attributes.encoded_event or self._node_event(attributes)
                    out += parts[0]
                    out += timestamp
                    out += parts[1]
            else:  # untimed events have no time field at all
                for attributes in span.node_events:
                    out += _field(0x5A, _NODE_EVENT_NAME + self._attributes(0x1A, attributes))
        for event in span.other_events:
            out += _field(0x5A, self._event(event))
        out += _status(span.status)
        out += b"\x85\x01"  # flags (field 16), fixed32
        out += _FIXED32(_flags(parent))
        return out

    def _node_event(self, attributes: FrozenAttributes) -> tuple[bytes, bytes]:
        """A timed node event's encoding as the bytes before its time and after it,
        made once and kept on the shared attributes."""
        rest = _NODE_EVENT_NAME + self._attributes(0x1A, attributes)
        head = _BYTES[0x5A] + _varint(len(rest) + 9) + b"\x09"  # then time_unix_nano
        attributes.encoded_event = (head, rest)
        return head, rest

    def _event(self, event: Any) -> bytes:
        timestamp = event.timestamp
        name = self._names.get(event.name)
        if name is None:
            name = _field(0x12, event.name.encode()) if event.name else b""
            if len(self._names) < _CACHE_LIMIT:
                self._names[event.name] = name
        out = b"\x09" + _FIXED64(timestamp) + name if timestamp else name  # time_unix_nano
        out += self._attributes(0x1A, event.attributes)
        if event.dropped_attributes:
            out += b"\x20" + _varint(event.dropped_attributes)
        return out

    def _link(self, link: Any) -> bytes:
        context = link.context
        out = bytearray(b"\x0a\x10")
        out += context.trace_id.to_bytes(16, "big")
        out += b"\x12\x08"
        out += context.span_id.to_bytes(8, "big")
        out += self._attributes(0x22, link.attributes)
        if link.dropped_attributes:
            out += b"\x28" + _varint(link.dropped_attributes)
        out += b"\x35"  # flags (field 6), fixed32
        out += _FIXED32(_flags(context))
        return bytes(out)

    def _attributes(self, tag: int, attributes: Mapping[str, Any] | None) -> bytes:
        """Repeated ``KeyValue`` under ``tag``; a pair that cannot be encoded is left out."""
        if not attributes:
            return b""
        if type(attributes) is FrozenAttributes:  # a node event shared by many spans
            encoded = attributes.encoded.get(tag)
            if encoded is None:
                encoded = attributes.encoded[tag] = self._pairs(tag, attributes)
            return encoded
        return self._pairs(tag, attributes)

    def _pairs(self, tag: int, attributes: Mapping[str, Any]) -> bytes:
        keys = self._keys.get(tag)
        if keys is None:
            keys = self._keys[tag] = {}
        out = bytearray()
        for key, value in attributes.items():
            known = keys.get(key)
            try:
                if known is None:
                    known = _Key(tag, key)
                    if len(keys) < _CACHE_LIMIT:
                        keys[key] = known
                kind = type(value)
                if kind is float:  # durations and scores: never the same twice
                    out += known.double_head
                    out += _DOUBLE(value)
                    continue
                pairs = known.pairs.get(kind)
                if pairs is None:
                    out += _pair(tag, known.key, value)
                    continue
                pair = pairs.get(value)
                if pair is None:
                    pair = _pair(tag, known.key, value)
                    if len(pairs) >= _CACHE_LIMIT:
                        pairs.clear()
                    pairs[value] = pair
            except (TypeError, ValueError):  # UnicodeError and int64 overflow included
                continue  # the SDK's encoder leaves such a pair out too
            out += pair
        return bytes(out)


class _Key:
    """One attribute key under one field tag: its encoding, and the pairs made with it.

    Most values repeat (policy, model, pod and node names, token counts,
    statuses): the whole encoded pair is kept per value, by exact type so that
    ``1``, ``1.0`` and ``True`` stay apart, and emptied past a bound (request
    ids never repeat). A double's pair is this head and the value's 8 bytes.
    """

    __slots__ = ("double_head", "key", "pairs")

    def __init__(self, tag: int, key: str) -> None:
        self.key = _field(0x0A, key.encode())
        value = b"\x12\x09\x21"  # KeyValue.value: an AnyValue of one double
        self.double_head = _BYTES[tag] + _varint(len(self.key) + 11) + self.key + value
        self.pairs: dict[type, dict[Any, bytes]] = {str: {}, int: {}, bool: {}}


def _pair(tag: int, key: bytes, value: Any) -> bytes:
    return _field(tag, key + _field(0x12, _any_value(value)))


def _any_value(value: Any) -> bytes:
    """An ``AnyValue`` body; the checks in the order the SDK's encoder makes them."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _field(0x0A, value.encode())
    if isinstance(value, int):
        return b"\x18" + _varint(_int64(value))
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _field(0x3A, value)
    if isinstance(value, Sequence):
        return _field(0x2A, b"".join([_field(0x0A, _any_value(item)) for item in value]))
    if isinstance(value, Mapping):
        pairs = b"".join(
            [
                _field(0x0A, _field(0x0A, str(k).encode()) + _field(0x12, _any_value(v)))
                for k, v in value.items()
            ]
        )
        return _field(0x32, pairs)
    raise TypeError(f"cannot encode a {type(value).__name__} attribute")


def _status(status: Status) -> bytes:
    """``Span.status`` (field 15): description, then code (absent when unset)."""
    key = (status.status_code, status.description)
    known = _STATUSES.get(key)
    if known is None:
        known = _STATUSES[key] = _encode_status(status)
        if len(_STATUSES) >= _CACHE_LIMIT:
            _STATUSES.clear()
    return known


_STATUSES: dict[tuple[Any, str | None], bytes] = {}  # by code and description: few recur


def _encode_status(status: Status) -> bytes:
    body = b""
    if status.description:
        body += _field(0x12, status.description.encode())
    if status.status_code.value:
        body += b"\x18" + _varint(status.status_code.value)
    return _field(0x7A, body)


def _trace_state(state: TraceState | None) -> str:
    return ",".join(f"{key}={value}" for key, value in state.items()) if state else ""


def _flags(parent: SpanContext | None) -> int:
    remote = parent is not None and parent.is_remote
    return _HAS_IS_REMOTE | _IS_REMOTE if remote else _HAS_IS_REMOTE
