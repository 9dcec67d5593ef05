"""The ext_proc replies policyd sends Envoy, built per the wire facts of Envoy 1.40.

- Header values are set with ``raw_value`` only (``value`` yields an empty
  header, both yield a 500) and always with OVERWRITE_IF_EXISTS_OR_ADD, so a
  client-supplied ``x-gateway-destination-endpoint`` never survives; it is also
  removed at the request-headers phase.
- The chosen endpoint (then the fallbacks, comma separated, when enabled) goes
  in the header and, identically, in dynamic metadata ``envoy.lb`` as the
  Gateway API Inference Extension endpoint-picker protocol asks.
- The routing reply is a request-*body* reply, whose header mutations Envoy
  applies only in BUFFERED body mode; it clears the route cache so routes
  matching on the new header are re-evaluated. A request without a body is
  routed by its request-*headers* reply (:func:`route_headers`), the same
  mutations and metadata in a ``HeadersResponse``.
- FULL_DUPLEX_STREAMED body mode (how gateways configure an InferencePool's
  endpoint picker; ``docs/endpoint-picker.md``): Envoy sends the body chunks
  without waiting for replies and forwards only what the server sends back.
  So the routing reply is the request-*headers* reply, sent once the whole
  body is in (:meth:`RouteReplies.route_before_body`), followed by the body
  itself as ``streamed_response`` body mutations (:func:`streamed_request_body`,
  echoed or rewritten); each response chunk is handed back the same way
  (:func:`streamed_response_body`).
- Errors are ImmediateResponses with an OpenAI-style JSON body.
- The prefill pod of a split request (disaggregated prefill/decode) is named
  in ``x-prefiller-host-port`` (``ServingSettings.prefill_header``), the
  header llm-d's P/D sidecar on the decode pod reads: one ``ip:port``. Only
  policyd may name it (a client's value would send the sidecar's prefill
  request anywhere), so every routing reply removes it and a split sets it
  again; Envoy applies a mutation's removals before its sets. The
  request-headers reply removes it too, as it does the destination.

Replies are protobuf wire bytes, which the gRPC server sends as they are:
those that never change are encoded once, routing replies once per
destination (:class:`RouteReplies`). What a request adds to its routing
reply (trace headers, a rewritten body) is encoded alone and appended: a
protobuf parser merges a message field that occurs twice and concatenates
repeated ones, so the bytes read as one reply holding both, without copying
the cached reply's ``envoy.lb`` metadata into a new message per request.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from policyd.extproc.errors import RequestError

DESTINATION_HEADER: Final = "x-gateway-destination-endpoint"
# llm-d's name for the prefill pod's host:port (pkg/common/routing in llm-d-router).
PREFILL_HEADER: Final = "x-prefiller-host-port"
LB_METADATA_NAMESPACE: Final = "envoy.lb"

_OVERWRITE: Final = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_HEADER_NAME: Final = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")


def is_header_name(name: str) -> bool:
    """Whether ``name`` is a lower-case HTTP header name (a token, RFC 9110)."""
    return _HEADER_NAME.fullmatch(name) is not None


def request_headers_continue(prefill_header: str = PREFILL_HEADER) -> bytes:
    """Request headers: continue, but drop any destination or prefill pod the client
    tried to pick."""
    reply: bytes = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(
                    remove_headers=[DESTINATION_HEADER, prefill_header]
                )
            )
        )
    ).SerializeToString()
    return reply


REQUEST_HEADERS_CONTINUE: Final = request_headers_continue()
# A request body chunk that is not the last one (STREAMED mode): nothing to do yet.
REQUEST_BODY_CONTINUE: Final[bytes] = pb.ProcessingResponse(
    request_body=pb.BodyResponse()
).SerializeToString()
REQUEST_TRAILERS_CONTINUE: Final[bytes] = pb.ProcessingResponse(
    request_trailers=pb.TrailersResponse()
).SerializeToString()
RESPONSE_HEADERS_CONTINUE: Final[bytes] = pb.ProcessingResponse(
    response_headers=pb.HeadersResponse()
).SerializeToString()
RESPONSE_BODY_CONTINUE: Final[bytes] = pb.ProcessingResponse(
    response_body=pb.BodyResponse()
).SerializeToString()
RESPONSE_TRAILERS_CONTINUE: Final[bytes] = pb.ProcessingResponse(
    response_trailers=pb.TrailersResponse()
).SerializeToString()

_JSON_CONTENT_TYPE: Final = pb.HeaderMutation(
    set_headers=[
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
            append_action=_OVERWRITE,
        )
    ]
)


_NO_HEADERS: Final[Mapping[str, str]] = {}


def _header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=_OVERWRITE,
    )


def destination_value(endpoint: str, fallbacks: Iterable[str] = ()) -> str:
    """``ip:port`` of the pick, then the fallbacks in order: ``a:1,b:2,...``."""
    return ",".join((endpoint, *fallbacks))


class RouteReplies:
    """Routing replies, the part that depends only on the destination encoded once.

    Building the ``envoy.lb`` metadata Struct costs about as much as the rest
    of a request's handling, and a pool has few destinations; so the reply for
    each destination is encoded once and handed out as is, with what a
    request adds appended (see the module docstring). Used from the event
    loop only, so the cache needs no lock; it is emptied when it holds
    ``limit`` destinations, which bounds it when pods come and go.
    """

    def __init__(self, limit: int = 4096, *, prefill_header: str = PREFILL_HEADER) -> None:
        self._limit = limit
        self.prefill_header = prefill_header
        self.request_headers_continue = (
            REQUEST_HEADERS_CONTINUE
            if prefill_header == PREFILL_HEADER
            else request_headers_continue(prefill_header)
        )
        # Per phase of the reply: the request body's (BUFFERED) or the request
        # headers' (FULL_DUPLEX_STREAMED, sent once the body is in).
        self._by_destination: dict[str, dict[str, bytes]] = {field: {} for field in _PHASE_TAGS}
        # What precedes a request's own bytes in an addition depends only on
        # lengths (a header's name and its value's length; the headers' total
        # length), so it too is encoded once per distinct value.
        self._header_heads: dict[tuple[str, int], bytes] = {}
        self._reply_heads: dict[tuple[str, int], bytes] = {}

    def route(
        self,
        destination: str,
        extra_headers: Mapping[str, str] = _NO_HEADERS,
        new_body: bytes | None = None,
    ) -> bytes:
        """The request-body reply that sends the request to ``destination`` (BUFFERED).

        ``extra_headers`` are added to the upstream request (trace context).
        ``new_body`` replaces the body (model rewrite); ``content-length`` is
        then set to its exact length.
        """
        return self._reply("request_body", destination, extra_headers, new_body, None)

    def route_before_body(
        self,
        destination: str,
        extra_headers: Mapping[str, str] = _NO_HEADERS,
        body_length: int | None = None,
    ) -> bytes:
        """The request-headers reply that sends the request to ``destination``
        (FULL_DUPLEX_STREAMED: sent once the body is in, before the body goes back
        as :func:`streamed_body` replies). ``body_length``: the length of a
        rewritten body, set as ``content-length``."""
        return self._reply("request_headers", destination, extra_headers, None, body_length)

    def _reply(
        self,
        phase: str,
        destination: str,
        extra_headers: Mapping[str, str],
        new_body: bytes | None,
        body_length: int | None,
    ) -> bytes:
        cache = self._by_destination[phase]
        base = cache.get(destination)
        if base is None:
            if len(cache) >= self._limit:
                cache.clear()
            base = cache[destination] = _route(destination, phase, self.prefill_header)
        if new_body is not None:
            body_length = len(new_body)
        if not extra_headers and body_length is None:
            return base  # the common reply: nothing of the request's own to add
        headers = b"".join([self._set_header(name, value) for name, value in extra_headers.items()])
        if body_length is not None:
            headers += self._set_header("content-length", str(body_length))
        if new_body is None:
            key = (phase, len(headers))
            head = self._reply_heads.get(key)
            if head is None:
                head = _kept(self._reply_heads, key, _reply_head(phase, len(headers)))
            return base + head + headers
        body = _BODY + _length(len(new_body)) + new_body
        mutation = _BODY_MUTATION + _length(len(body)) + body
        return base + _reply_head(phase, len(headers), len(mutation)) + headers + mutation

    def _set_header(self, name: str, value: str) -> bytes:
        """One ``HeaderMutation.set_headers`` entry: ``_header(name, value)``, encoded."""
        raw = value.encode()
        key = (name, len(raw))
        head = self._header_heads.get(key)
        if head is None:
            head = _kept(self._header_heads, key, _set_header_head(name, len(raw)))
        return head + raw + _OVERWRITE_ACTION


_HEADS_KEPT: Final = 256  # encoded heads kept per kind; the lengths that recur are few


def _kept(cache: dict[Any, bytes], key: Any, value: bytes) -> bytes:
    if len(cache) >= _HEADS_KEPT:
        cache.clear()
    cache[key] = value
    return value


def route_headers(
    destination: str,
    extra_headers: Mapping[str, str] = _NO_HEADERS,
    prefill_header: str = PREFILL_HEADER,
) -> bytes:
    """The request-headers reply that sends a body-less request to ``destination``.

    Built whole each time: body-less requests (``GET /v1/models``) are few.
    """
    common = _routing(destination, prefill_header, extra_headers)
    reply: bytes = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=common),
        dynamic_metadata=_lb_metadata(destination),
    ).SerializeToString()
    return reply


def _route(destination: str, phase: str, prefill_header: str) -> bytes:
    """The routing reply of ``phase`` (``request_body`` or ``request_headers``)."""
    answer = pb.BodyResponse if phase == "request_body" else pb.HeadersResponse
    reply: bytes = pb.ProcessingResponse(
        **{phase: answer(response=_routing(destination, prefill_header))},
        dynamic_metadata=_lb_metadata(destination),
    ).SerializeToString()
    return reply


def _routing(
    destination: str, prefill_header: str, extra_headers: Mapping[str, str] = _NO_HEADERS
) -> pb.CommonResponse:
    common = pb.CommonResponse(clear_route_cache=True)
    common.header_mutation.remove_headers.append(prefill_header)
    set_headers = common.header_mutation.set_headers
    set_headers.append(_header(DESTINATION_HEADER, destination))
    set_headers.extend(_header(name, value) for name, value in extra_headers.items())
    return common


def _lb_metadata(destination: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(LB_METADATA_NAMESPACE)[DESTINATION_HEADER] = destination
    return metadata


# The tags (field number, length-delimited) of the fields an addition to a
# routing reply is made of; every number is under 16, so each tag is one byte.
def _tag(message: Any, field: str) -> bytes:
    return bytes((message.DESCRIPTOR.fields_by_name[field].number << 3 | 2,))


_REQUEST_BODY: Final = _tag(pb.ProcessingResponse, "request_body")
_RESPONSE_BODY: Final = _tag(pb.ProcessingResponse, "response_body")
# The routing reply's phase -> its tag in ProcessingResponse (HeadersResponse and
# BodyResponse both hold the CommonResponse as field ``response``, so the rest of
# a routing reply is encoded alike).
_PHASE_TAGS: Final = {
    "request_body": _REQUEST_BODY,
    "request_headers": _tag(pb.ProcessingResponse, "request_headers"),
}
_BODY_RESPONSE: Final = _tag(pb.BodyResponse, "response")  # = HeadersResponse's
_HEADER_MUTATION: Final = _tag(pb.CommonResponse, "header_mutation")
_BODY_MUTATION: Final = _tag(pb.CommonResponse, "body_mutation")
_SET_HEADERS: Final = _tag(pb.HeaderMutation, "set_headers")
_BODY: Final = _tag(pb.BodyMutation, "body")
_STREAMED_RESPONSE: Final = _tag(pb.BodyMutation, "streamed_response")
_STREAMED_BODY: Final = _tag(pb.StreamedBodyResponse, "body")
_END_OF_STREAM: Final = bytes(  # end_of_stream: true, a varint field
    (pb.StreamedBodyResponse.DESCRIPTOR.fields_by_name["end_of_stream"].number << 3, 1)
)
_OPTION_HEADER: Final = _tag(base_pb2.HeaderValueOption, "header")
_KEY: Final = _tag(base_pb2.HeaderValue, "key")
_RAW_VALUE: Final = _tag(base_pb2.HeaderValue, "raw_value")
_OVERWRITE_ACTION: Final = bytes(  # append_action, a varint field
    (base_pb2.HeaderValueOption.DESCRIPTOR.fields_by_name["append_action"].number << 3, _OVERWRITE)
)
_SMALL: Final = [bytes((n,)) for n in range(0x80)]  # lengths under 128: one byte


def _length(size: int) -> bytes:
    return _SMALL[size] if size < 0x80 else _varint(size)


def _varint(value: int) -> bytes:
    """A protobuf varint (lengths of 128 bytes and more)."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _reply_head(phase: str, headers_size: int, mutation_size: int = 0) -> bytes:
    """What precedes ``set_headers`` entries of ``headers_size`` bytes (then a body
    mutation field of ``mutation_size``) in ``ProcessingResponse.<phase>.response``."""
    common = len(_HEADER_MUTATION) + len(_length(headers_size)) + headers_size + mutation_size
    response = len(_BODY_RESPONSE) + len(_length(common)) + common
    return (
        _PHASE_TAGS[phase]
        + _length(response)
        + _BODY_RESPONSE
        + _length(common)
        + _HEADER_MUTATION
        + _length(headers_size)
    )


def _set_header_head(name: str, value_size: int) -> bytes:
    """What precedes a value of ``value_size`` bytes in a ``set_headers`` entry for ``name``
    (the entry ends with ``_OVERWRITE_ACTION``)."""
    key = name.encode()
    header = len(_KEY) + len(_length(len(key))) + len(key)
    header += len(_RAW_VALUE) + len(_length(value_size)) + value_size
    option = len(_OPTION_HEADER) + len(_length(header)) + header + len(_OVERWRITE_ACTION)
    return (
        _SET_HEADERS
        + _length(option)
        + _OPTION_HEADER
        + _length(header)
        + _KEY
        + _length(len(key))
        + key
        + _RAW_VALUE
        + _length(value_size)
    )


# A FULL_DUPLEX_STREAMED body goes back in pieces of at most this many bytes:
# Envoy's ext_proc documentation (processing_mode.proto, FULL_DUPLEX_STREAMED)
# recommends response chunks of no more than 64 KiB.
STREAMED_CHUNK_BYTES: Final = 64 * 1024


def streamed_request_body(body: bytes, end_of_stream: bool) -> list[bytes]:
    """The request body handed back to Envoy (FULL_DUPLEX_STREAMED), in pieces."""
    return _streamed(_REQUEST_BODY, body, end_of_stream)


def streamed_response_body(chunk: bytes, end_of_stream: bool) -> bytes | list[bytes]:
    """A response body chunk handed back unchanged (FULL_DUPLEX_STREAMED): one reply
    for a chunk of up to ``STREAMED_CHUNK_BYTES`` (nearly all are), else several."""
    if len(chunk) <= STREAMED_CHUNK_BYTES:
        head = _streamed_head(_RESPONSE_BODY, len(chunk), end_of_stream)
        return head + chunk + _ending(end_of_stream)
    return _streamed(_RESPONSE_BODY, chunk, end_of_stream)


def _streamed(phase: bytes, body: bytes, end_of_stream: bool) -> list[bytes]:
    """``ProcessingResponse.<phase>.response.body_mutation.streamed_response`` replies
    carrying ``body``, the last one marked ``end_of_stream`` when asked.

    Encoded by hand: a streaming generation's every chunk passes here. What
    precedes a piece depends only on the phase, the piece's length and whether
    it ends the body, so it is encoded once per such key.
    """
    size = STREAMED_CHUNK_BYTES
    if len(body) <= size:  # the common case: one piece
        return [_streamed_head(phase, len(body), end_of_stream) + body + _ending(end_of_stream)]
    pieces = [body[start : start + size] for start in range(0, len(body), size)]
    last = len(pieces) - 1
    return [
        _streamed_head(phase, len(piece), ends) + piece + _ending(ends)
        for index, piece in enumerate(pieces)
        for ends in (end_of_stream and index == last,)
    ]


_STREAMED_HEADS: Final[dict[tuple[bytes, int, bool], bytes]] = {}


def _ending(end_of_stream: bool) -> bytes:
    return _END_OF_STREAM if end_of_stream else b""


def _streamed_head(phase: bytes, piece_size: int, end_of_stream: bool) -> bytes:
    """What precedes a streamed piece of ``piece_size`` bytes (which is followed by
    ``_ending(end_of_stream)``)."""
    key = (phase, piece_size, end_of_stream)
    head = _STREAMED_HEADS.get(key)
    if head is not None:
        return head
    streamed = len(_STREAMED_BODY) + len(_length(piece_size)) + piece_size
    streamed += len(_ending(end_of_stream))
    mutation = len(_STREAMED_RESPONSE) + len(_length(streamed)) + streamed
    common = len(_BODY_MUTATION) + len(_length(mutation)) + mutation
    response = len(_BODY_RESPONSE) + len(_length(common)) + common
    head = b"".join(
        (
            phase,
            _length(response),
            _BODY_RESPONSE,
            _length(common),
            _BODY_MUTATION,
            _length(mutation),
            _STREAMED_RESPONSE,
            _length(streamed),
            _STREAMED_BODY,
            _length(piece_size),
        )
    )
    return _kept(_STREAMED_HEADS, key, head)


def immediate(error: RequestError) -> bytes:
    """An error answered by Envoy directly; the request never reaches a pod.

    A ``retry_after`` on the error becomes a ``Retry-After`` header.
    """
    headers = _JSON_CONTENT_TYPE
    if error.retry_after is not None:
        headers = pb.HeaderMutation(
            set_headers=[
                *_JSON_CONTENT_TYPE.set_headers,
                _header("retry-after", str(error.retry_after)),
            ]
        )
    reply: bytes = pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=headers,
            body=error.json_body(),
            details=f"policyd_{error.code}",
        )
    ).SerializeToString()
    return reply
