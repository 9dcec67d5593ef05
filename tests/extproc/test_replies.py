"""Routing replies: a request's additions appended to the cached bytes read as one reply."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from policyd.extproc import replies
from policyd.extproc.errors import RequestError

TRACE = ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")


def parsed(data: bytes) -> pb.ProcessingResponse:
    return pb.ProcessingResponse.FromString(data)


def headers(reply: pb.ProcessingResponse) -> list[tuple[str, bytes, int]]:
    mutation = reply.request_body.response.header_mutation
    return [(h.header.key, h.header.raw_value, h.append_action) for h in mutation.set_headers]


def test_a_plain_route_names_the_destination_in_a_header_and_in_lb_metadata() -> None:
    reply = parsed(replies.RouteReplies().route("10.0.0.7:8000"))
    overwrite = 2  # OVERWRITE_IF_EXISTS_OR_ADD
    assert headers(reply) == [(replies.DESTINATION_HEADER, b"10.0.0.7:8000", overwrite)]
    assert reply.request_body.response.clear_route_cache
    lb = reply.dynamic_metadata.fields[replies.LB_METADATA_NAMESPACE].struct_value
    assert lb.fields[replies.DESTINATION_HEADER].string_value == "10.0.0.7:8000"


@pytest.mark.parametrize("prompt", [None, "hi", "long " * 3000])  # lengths of 1 and 2+ bytes
@pytest.mark.parametrize("extra", [[], [TRACE], [TRACE, ("x-long", "v" * 300)]])
def test_added_headers_and_body_merge_into_the_cached_reply(
    prompt: str | None, extra: list[tuple[str, str]]
) -> None:
    routes = replies.RouteReplies()
    plain = parsed(routes.route("10.0.0.7:8000"))
    body = None if prompt is None else f'{{"model":"base","prompt":"{prompt}"}}'.encode()
    reply = parsed(routes.route("10.0.0.7:8000", dict(extra), body))
    expected = pb.ProcessingResponse()
    expected.CopyFrom(plain)
    common = expected.request_body.response
    added = list(extra)
    if body is not None:
        common.body_mutation.body = body
        added.append(("content-length", str(len(body))))
    for name, value in added:
        added = common.header_mutation.set_headers.add()
        added.header.key = name
        added.header.raw_value = value.encode()
        added.append_action = 2
    assert reply == expected
    assert routes.route("10.0.0.7:8000") == routes.route("10.0.0.7:8000")  # cached bytes
    assert parsed(routes.route("10.0.0.7:8000")) == plain  # additions never stick


def test_the_cache_is_bounded() -> None:
    routes = replies.RouteReplies(limit=2)
    for port in range(5):
        destination = f"10.0.0.1:{port}"
        assert headers(parsed(routes.route(destination)))[0][1] == destination.encode()
    assert len(routes._by_destination) <= 2


def test_an_error_is_an_immediate_json_response() -> None:
    reply = parsed(replies.immediate(RequestError(429, "all pods are busy", "shed")))
    immediate = reply.immediate_response
    assert immediate.status.code == 429
    assert immediate.details == "policyd_shed"
    assert immediate.headers.set_headers[0].header.raw_value == b"application/json"
    assert b"all pods are busy" in immediate.body
