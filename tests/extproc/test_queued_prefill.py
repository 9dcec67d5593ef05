"""A routed request's uncached prompt counts in its pod's queued prefill until its first
token, and comes out of it exactly once however the exchange goes on: a first body
chunk, a whole answer, an error answer, the client going away, the response watch's
expiry, or a fallback serving it instead.

Driven without an event loop, as ``test_exchange_state`` drives an exchange.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from extproc_support import (
    PickFirst,
    Snapshot,
    request_body,
    request_headers,
    response_body,
    response_headers,
)

from policyd.extproc import epp
from policyd.extproc.exchange import Exchange
from policyd.extproc.exchange_state import State
from policyd.extproc.process_stream import ExternalProcessor
from policyd.extproc.serving import ServingSettings
from policyd.policy.decision import Decision
from policyd.policy.request import Request
from policyd.pool.pod import Pod
from policyd.telemetry.exchange_end import ExchangeEnd

BODY = {"model": "m", "prompt": "tell me about queues " * 40, "stream": True}


class Quiet:
    """A telemetry double that records nothing: these tests read the pods."""

    upstream_headers: Mapping[str, str] = {}

    def start(self, *arguments: Any) -> Quiet:
        return self

    def after_reply(self, shadows: Any = None) -> None: ...
    def response_headers(self, status: int, seconds: float) -> None: ...
    def end(self, end: ExchangeEnd) -> None: ...
    def stream_error(self, kind: str, code: str) -> None: ...


class HalfCached(PickFirst):
    """Routes to the first candidate, having found half the prompt cached there."""

    def decide(self, request: Request, candidates: Sequence[Pod], prompt: Any = None) -> Decision:
        decision = super().decide(request, candidates)
        decision.prefix_match = 0.5
        return decision


def pods() -> tuple[Pod, Pod]:
    return Pod("pod-0", "10.0.0.1:8000"), Pod("pod-1", "10.0.0.2:8000")


def routed(pool: Sequence[Pod], router: Any = None) -> tuple[Exchange, PickFirst]:
    router = router or PickFirst()
    server = ExternalProcessor(
        lambda: router,
        lambda: Snapshot(tuple(pool)),
        Quiet(),
        ServingSettings(in_flight_expiry_seconds=0),
    )
    ex = Exchange(server, tuple)
    for message in (request_headers(), request_body(BODY)):
        assert ex.handle(message) is not None
        ex.reply_sent()
    assert ex.state is State.ROUTED
    return ex, router


def prompt_tokens(router: PickFirst) -> int:
    (request,) = router.seen
    assert request.prompt_tokens > 100
    return request.prompt_tokens


def test_a_streamed_answer_releases_its_prefill_at_its_first_chunk_once() -> None:
    pool = pods()
    ex, router = routed(pool)
    assert pool[0].queued_prefill_tokens == prompt_tokens(router)
    assert pool[1].queued_prefill_tokens == 0
    ex.handle(response_headers(200, "text/event-stream"))
    assert pool[0].queued_prefill_tokens == prompt_tokens(router)  # headers are no token
    ex.handle(response_body(b""))  # nor is an empty chunk
    assert pool[0].queued_prefill_tokens == prompt_tokens(router)
    ex.handle(response_body(b'data: {"choices": []}\n\n'))
    assert pool[0].queued_prefill_tokens == 0
    assert pool[0].in_flight == 1  # still decoding
    ex.handle(response_body(b"data: [DONE]\n\n", end_of_stream=True))
    assert pool[0].queued_prefill_tokens == 0 and pool[0].in_flight == 0


def test_only_the_uncached_part_of_the_prompt_is_queued() -> None:
    pool = pods()
    ex, router = routed(pool, HalfCached())
    assert pool[0].queued_prefill_tokens == round(prompt_tokens(router) * 0.5)
    ex.handle(response_headers(200, end_of_stream=True))
    assert pool[0].queued_prefill_tokens == 0


def test_two_requests_on_one_pod_add_up_and_come_out_apart() -> None:
    pool = pods()
    first, router = routed(pool)
    second, _ = routed(pool)
    each = prompt_tokens(router)
    assert pool[0].queued_prefill_tokens == 2 * each
    first.handle(response_headers(200, "text/event-stream"))
    first.handle(response_body(b"data: {}\n\n"))
    assert pool[0].queued_prefill_tokens == each
    second.close(reset=True)
    assert pool[0].queued_prefill_tokens == 0


def test_a_whole_answer_releases_it_at_its_body() -> None:
    pool = pods()
    ex, _ = routed(pool)
    ex.handle(response_headers(200))
    assert pool[0].queued_prefill_tokens > 0
    ex.handle(response_body(b'{"choices": []}', end_of_stream=True))
    assert pool[0].queued_prefill_tokens == 0


def test_an_error_answer_releases_it() -> None:
    pool = pods()
    ex, _ = routed(pool)
    ex.handle(response_headers(503, end_of_stream=True))
    assert ex.state is State.ENDED
    assert pool[0].queued_prefill_tokens == 0


def test_the_client_going_away_releases_it_before_and_after_the_response_began() -> None:
    pool = pods()
    waiting, _ = routed(pool)
    waiting.close(reset=True)  # no response yet
    assert waiting.state is State.ABORTED
    assert pool[0].queued_prefill_tokens == 0
    responding, _ = routed(pool)
    responding.handle(response_headers(200, "text/event-stream"))
    responding.close(reset=True)  # gone before the first token
    assert pool[0].queued_prefill_tokens == 0 and pool[0].in_flight == 0


def test_the_response_watch_expiry_releases_it_and_the_end_does_not_again() -> None:
    pool = pods()
    ex, _ = routed(pool)
    assert ex.expire()
    assert pool[0].queued_prefill_tokens == 0
    ex.handle(response_headers(200, "text/event-stream"))
    ex.handle(response_body(b"data: {}\n\n", end_of_stream=True))
    assert pool[0].queued_prefill_tokens == 0 and pool[0].in_flight == 0


def test_a_fallback_serving_it_takes_the_prefill_with_it() -> None:
    pool = pods()
    ex, router = routed(pool)
    message = response_headers(200, "text/event-stream")
    message.metadata_context.filter_metadata["envoy.lb"].update({epp.SERVED_KEY: pool[1].address})
    ex.handle(message)
    assert pool[0].queued_prefill_tokens == 0
    assert pool[1].queued_prefill_tokens == prompt_tokens(router)
    ex.handle(response_body(b"data: {}\n\n"))
    assert pool[1].queued_prefill_tokens == 0 and pool[1].in_flight == 1
