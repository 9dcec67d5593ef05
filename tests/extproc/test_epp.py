"""The endpoint-picker protocol's FULL_DUPLEX_STREAMED exchange, its subset and served
endpoint, message by message (the same through the real Envoy: tests/e2e/test_epp_protocol.py).

Driven without an event loop, as ``test_exchange_state`` drives an exchange.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from extproc_support import (
    Mode,
    PickFirst,
    Snapshot,
    error_of,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)
from google.protobuf import struct_pb2

from policyd.extproc import epp
from policyd.extproc.envoy_config import EnvoyConfigOptions, bootstrap
from policyd.extproc.errors import RequestError
from policyd.extproc.exchange import Exchange
from policyd.extproc.exchange_state import State
from policyd.extproc.process_stream import ExternalProcessor
from policyd.extproc.replies import DESTINATION_HEADER, STREAMED_CHUNK_BYTES
from policyd.extproc.serving import ServingSettings
from policyd.policy.decision import Decision
from policyd.policy.request import Request
from policyd.pool.pod import Pod
from policyd.telemetry.exchange_end import ExchangeEnd

PODS = (Pod("pod-0", "10.0.0.1:8000"), Pod("pod-1", "10.0.0.2:8000"), Pod("pod-2", "10.0.0.3:9"))
Replies = Any


class Recorder:
    """A telemetry double: every span it opens is a no-op; stream errors are kept."""

    def __init__(self) -> None:
        self.upstream_headers: dict[str, str] = {}
        self.errors: list[tuple[str, str]] = []

    def start(self, *arguments: Any) -> Recorder:
        return self

    def after_reply(self, shadows: Any = None) -> None: ...
    def response_headers(self, status: int, seconds: float) -> None: ...
    def end(self, end: ExchangeEnd) -> None: ...

    def stream_error(self, kind: str, code: str) -> None:
        self.errors.append((kind, code))


class Rewriting(PickFirst):
    """Routes to the first candidate and rewrites the model to ``target``."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target
        self.candidates: list[Sequence[Pod]] = []

    def decide(self, request: Request, candidates: Sequence[Pod], prompt: Any = None) -> Decision:
        self.candidates.append(candidates)
        decision = super().decide(request, candidates)
        return Decision(
            decision.outcome,
            "test",
            "1",
            self.target or request.model,
            endpoint=decision.endpoint,
            pod=decision.pod,
            chosen=candidates[0],
        )


def server(router: Any, **settings: Any) -> ExternalProcessor:
    return ExternalProcessor(
        lambda: router,
        lambda: Snapshot(PODS),
        Recorder(),
        ServingSettings(in_flight_expiry_seconds=0, **settings),
    )


def duplex(router: Any = None, **settings: Any) -> tuple[Exchange, Any]:
    router = router or Rewriting("")
    return Exchange(server(router, **settings), tuple), router


def headers_message(
    subset: Any = None, extra: dict[str, str] | None = None
) -> pb.ProcessingRequest:
    message = request_headers(extra, body_mode=Mode.FULL_DUPLEX_STREAMED)
    message.protocol_config.response_body_mode = Mode.FULL_DUPLEX_STREAMED
    if subset is not None:
        namespace = message.metadata_context.filter_metadata[epp.SUBSET_NAMESPACE]
        namespace.update({epp.SUBSET_KEY: subset})
    return message


def parsed(replies: Replies) -> list[pb.ProcessingResponse]:
    if isinstance(replies, bytes):
        replies = [replies]
    assert isinstance(replies, tuple | list), replies
    return [pb.ProcessingResponse.FromString(reply) for reply in replies]


def streamed(reply: pb.ProcessingResponse) -> tuple[str, bytes, bool]:
    phase = reply.WhichOneof("response")
    mutation = getattr(reply, phase).response.body_mutation.streamed_response
    return phase, mutation.body, mutation.end_of_stream


def sent(exchange: Exchange, message: pb.ProcessingRequest) -> Replies:
    replies = exchange.handle(message)
    exchange.reply_sent()
    return replies


def routed(exchange: Exchange, document: bytes, *, trailers: bool = False) -> Replies:
    """Headers, then ``document`` in three chunks (ended by trailers when asked):
    the replies to the message that completed the body."""
    assert sent(exchange, headers_message()) == ()
    third = len(document) // 3
    chunks = [document[:third], document[third : 2 * third], document[2 * third :]]
    for index, piece in enumerate(chunks):
        last = index == len(chunks) - 1 and not trailers
        replies = sent(exchange, request_body(piece, end_of_stream=last))
        if not last:
            assert replies == ()  # gathered: nothing answered yet
    if trailers:
        replies = sent(exchange, pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    return replies


def test_the_routing_waits_for_the_whole_body_then_comes_in_envoys_order() -> None:
    exchange, _ = duplex()
    document = json.dumps({"model": "m", "prompt": "p" * 200_000}).encode()
    replies = parsed(routed(exchange, document))
    assert exchange.state is State.ROUTED and PODS[0].in_flight == 1
    head, *body = replies
    assert head.WhichOneof("response") == "request_headers"
    assert set_headers(head)[DESTINATION_HEADER].header.raw_value == PODS[0].address.encode()
    assert head.request_headers.response.clear_route_cache
    lb = head.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb[DESTINATION_HEADER].string_value == PODS[0].address
    # The body goes back echoed, in pieces of at most 64 KiB, the last one ending it.
    pieces = [streamed(reply) for reply in body]
    assert len(pieces) == -(-len(document) // STREAMED_CHUNK_BYTES)
    assert {phase for phase, _, _ in pieces} == {"request_body"}
    assert b"".join(piece for _, piece, _ in pieces) == document
    assert [end for _, _, end in pieces] == [False] * (len(pieces) - 1) + [True]
    exchange.close()
    assert PODS[0].in_flight == 0


def test_a_body_ended_by_trailers_is_routed_and_the_trailers_answered_last() -> None:
    exchange, _ = duplex()
    document = json.dumps({"model": "m", "prompt": "hello"}).encode()
    head, *body, trailers = parsed(routed(exchange, document, trailers=True))
    assert head.WhichOneof("response") == "request_headers"
    assert [streamed(reply) for reply in body] == [("request_body", document, False)]
    assert trailers.WhichOneof("response") == "request_trailers"
    exchange.close()


def test_a_rewritten_model_goes_back_as_the_body_with_its_length() -> None:
    exchange, _ = duplex(Rewriting("m-lora"))
    document = {"model": "m", "prompt": "héllo", "max_tokens": 3}
    head, *body = parsed(routed(exchange, json.dumps(document).encode()))
    sent_body = b"".join(streamed(reply)[1] for reply in body)
    assert json.loads(sent_body) == {**document, "model": "m-lora"}
    assert set_headers(head)["content-length"].header.raw_value == str(len(sent_body)).encode()
    exchange.close()


def test_a_malformed_body_is_a_400_once_it_is_whole() -> None:
    exchange, _ = duplex()
    (answer,) = [pb.ProcessingResponse.FromString(routed(exchange, b"{not json"))]
    status, error = error_of(answer)
    assert (status, error["code"]) == (400, "invalid_json")
    assert exchange.state is State.ENDED


def test_bodies_past_the_servers_budget_are_a_429_while_they_are_gathered() -> None:
    exchange, _ = duplex(max_body_bytes=100, max_buffered_body_bytes=100)
    assert sent(exchange, headers_message()) == ()
    assert sent(exchange, request_body(b"x" * 60, end_of_stream=False)) == ()
    answer = pb.ProcessingResponse.FromString(
        sent(exchange, request_body(b"x" * 60, end_of_stream=False))
    )
    assert error_of(answer)[0] == 413  # one body past its own limit
    shared = server(Rewriting(""), max_body_bytes=100, max_buffered_body_bytes=150)
    other, third = Exchange(shared, tuple), Exchange(shared, tuple)  # one budget for both
    assert sent(other, headers_message()) == ()
    assert sent(other, request_body(b"x" * 90, end_of_stream=False)) == ()
    assert sent(third, headers_message()) == ()
    answer = pb.ProcessingResponse.FromString(
        sent(third, request_body(b"y" * 90, end_of_stream=False))
    )
    assert error_of(answer)[0] == 429
    other.close()


def test_each_response_chunk_goes_back_unchanged_and_the_last_ends_the_exchange() -> None:
    exchange, _ = duplex()
    routed(exchange, json.dumps({"model": "m", "prompt": "p"}).encode())
    assert sent(exchange, response_headers(200, "text/event-stream")) is not None
    events = [b'data: {"choices":[]}\n\n', b'data: {"usage":{"prompt_tokens":1}}\n\n']
    first = parsed(sent(exchange, response_body(events[0])))
    assert [streamed(reply) for reply in first] == [("response_body", events[0], False)]
    assert exchange.state is State.RESPONDING
    last = parsed(exchange.handle(response_body(events[1], end_of_stream=True)))
    assert [streamed(reply) for reply in last] == [("response_body", events[1], True)]
    assert exchange.state is State.ENDED and PODS[0].in_flight == 0


def test_a_response_chunk_over_64_kib_goes_back_in_pieces() -> None:
    exchange, _ = duplex()
    routed(exchange, json.dumps({"model": "m", "prompt": "p"}).encode())
    sent(exchange, response_headers(200))
    big = bytes(range(256)) * 600  # 150 KiB
    pieces = [
        streamed(reply) for reply in parsed(exchange.handle(response_body(big, end_of_stream=True)))
    ]
    assert [len(piece) for _, piece, _ in pieces] == [65536, 65536, len(big) - 131072]
    assert b"".join(piece for _, piece, _ in pieces) == big
    assert [end for _, _, end in pieces] == [False, False, True]


def test_response_trailers_are_answered_in_full_duplex_mode() -> None:
    exchange, _ = duplex()
    routed(exchange, json.dumps({"model": "m", "prompt": "p"}).encode())
    sent(exchange, response_headers(200))
    sent(exchange, response_body(b"{}", end_of_stream=False))
    reply = exchange.handle(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert isinstance(reply, bytes)
    assert pb.ProcessingResponse.FromString(reply).WhichOneof("response") == "response_trailers"
    assert exchange.state is State.ENDED


@pytest.mark.parametrize(
    ("subset", "seen"),
    [
        (["10.0.0.2:8000"], ["pod-1"]),
        (["10.9.9.9:1", "10.0.0.3:9"], ["pod-2"]),
        (["10.0.0.2"], ["pod-1"]),  # no port: the pod's IP
        ("10.0.0.3:9, 10.0.0.2:8000", ["pod-1", "pod-2"]),  # one string, comma separated
        (None, ["pod-0", "pod-1", "pod-2"]),  # no subset: the whole pool
    ],
)
def test_the_router_sees_only_the_proxys_subset(subset: Any, seen: list[str]) -> None:
    exchange, router = duplex()
    sent(exchange, headers_message(subset))
    head, *_ = parsed(sent(exchange, request_body(b'{"model":"m","prompt":"p"}')))
    assert [pod.name for pod in router.candidates[-1]] == seen
    (first,) = [pod for pod in PODS if pod.name == seen[0]]
    assert set_headers(head)[DESTINATION_HEADER].header.raw_value.decode() == first.address
    exchange.close()


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:1"], {}])
def test_a_subset_with_no_pod_of_the_pool_is_a_503(subset: Any) -> None:
    exchange, router = duplex()
    sent(exchange, headers_message(subset))
    answer = pb.ProcessingResponse.FromString(
        sent(exchange, request_body(b'{"model":"m","prompt":"p"}'))
    )
    status, error = error_of(answer)
    assert (status, error["code"]) == (503, "no_subset_endpoints")
    assert router.seen == []


def test_a_subset_policyd_cannot_read_is_a_503_naming_it() -> None:
    exchange, _ = duplex()
    answer = pb.ProcessingResponse.FromString(sent(exchange, headers_message(7)))
    status, error = error_of(answer)
    assert (status, error["code"]) == (503, "bad_endpoint_subset")
    assert epp.SUBSET_KEY in error["message"]


def test_the_same_subset_of_the_same_candidates_is_the_same_tuple() -> None:
    subsets = epp.Subsets()
    once = subsets.narrow(PODS, ("10.0.0.1:8000", "10.0.0.3:9"))
    assert [pod.name for pod in once] == ["pod-0", "pod-2"]
    assert subsets.narrow(PODS, ("10.0.0.1:8000", "10.0.0.3:9")) is once  # walks stay reused
    fewer = PODS[:1]
    assert subsets.narrow(fewer, ("10.0.0.1:8000", "10.0.0.3:9")) == fewer  # a new snapshot
    with pytest.raises(RequestError):
        subsets.narrow(fewer, ("10.0.0.3:9",))


def test_the_served_endpoint_moves_the_in_flight_count_to_the_pod_that_served() -> None:
    exchange, _ = duplex()
    routed(exchange, json.dumps({"model": "m", "prompt": "p"}).encode())
    assert [pod.in_flight for pod in PODS] == [1, 0, 0]
    message = response_headers(200)
    lb = message.metadata_context.filter_metadata["envoy.lb"]
    lb.update({epp.SERVED_KEY: PODS[1].address})
    sent(exchange, message)
    assert [pod.in_flight for pod in PODS] == [0, 1, 0]
    exchange.handle(response_body(b"{}", end_of_stream=True))
    assert [pod.in_flight for pod in PODS] == [0, 0, 0]


def test_a_served_endpoint_that_is_no_candidate_leaves_the_count_where_it_is() -> None:
    exchange, _ = duplex()
    routed(exchange, json.dumps({"model": "m", "prompt": "p"}).encode())
    message = response_headers(200)
    served = struct_pb2.Struct()
    served.update({epp.SERVED_KEY: "10.9.9.9:1"})
    message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(served)
    sent(exchange, message)
    assert [pod.in_flight for pod in PODS] == [1, 0, 0]
    exchange.close()
    assert [pod.in_flight for pod in PODS] == [0, 0, 0]


def test_the_inference_pool_filter_is_shaped_like_istios() -> None:
    """The shape of ``BuildInferencePoolExtProcFilter`` (istio/istio,
    pilot/pkg/xds/filters/filters.go), plus the subset namespace forwarded."""
    config = bootstrap(EnvoyConfigOptions(ext_proc_mode="inference-pool"))
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (ext_proc,) = [
        f["typed_config"]
        for f in manager["typed_config"]["http_filters"]
        if f["name"] == "envoy.filters.http.ext_proc"
    ]
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_header_mode": "SEND",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "response_trailer_mode": "SEND",
    }
    assert (ext_proc["message_timeout"], ext_proc["grpc_service"]["timeout"]) == ("1000s", "10s")
    assert ext_proc["failure_mode_allow"] is False
    assert "allow_mode_override" not in ext_proc
    assert ext_proc["metadata_options"] == {
        "receiving_namespaces": {"untyped": ["envoy.lb"]},
        "forwarding_namespaces": {"untyped": ["envoy.lb", epp.SUBSET_NAMESPACE]},
    }
    # An explicit timeout wins in either mode; the buffered default stays 1 s.
    explicit = EnvoyConfigOptions(ext_proc_mode="inference-pool", message_timeout_ms=250)
    assert explicit.message_timeout == "0.25s"
    assert EnvoyConfigOptions().message_timeout == "1s"
    with pytest.raises(ValueError, match="ext_proc_mode"):
        EnvoyConfigOptions(ext_proc_mode="streamed")
