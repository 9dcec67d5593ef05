"""An exchange's state, and its end: one owner, and telemetry called in order after the reply.

Driven without an event loop, the settlement does its work at once, so what
telemetry got is visible right after each step.
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

from policyd.extproc.exchange import Exchange
from policyd.extproc.exchange_state import State
from policyd.extproc.process_stream import ExternalProcessor
from policyd.extproc.serving import ServingSettings
from policyd.policy.decision import (
    Agreement,
    Decision,
    Outcome,
    ShadowInputs,
    ShadowReport,
    ShadowResult,
)
from policyd.policy.request import Request
from policyd.pool.pod import Pod
from policyd.telemetry.exchange_end import ExchangeEnd

BODY = {"model": "m", "prompt": "hello"}
PODS = (Pod("pod-0", "10.0.0.1:8000"), Pod("pod-1", "10.0.0.2:8000"))


class CallLog:
    """A telemetry double writing every call, in order, into one list."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def start(
        self, request: Request, decision: Decision, carrier: Mapping[str, str], seconds: float
    ) -> CallLog:
        self.calls.append(("start", decision.outcome.value))
        return self

    upstream_headers: Mapping[str, str] = {}

    def after_reply(self, shadows: ShadowReport | None = None) -> None:
        self.calls.append(("after_reply", shadows))

    def response_headers(self, status: int, seconds_to_headers: float) -> None:
        self.calls.append(("response_headers", status))

    def end(self, end: ExchangeEnd) -> None:
        self.calls.append(("end", end.completed))

    def stream_error(self, kind: str, code: str) -> None:
        self.calls.append(("stream_error", kind, code))

    def names(self) -> list[Any]:
        return [call[0] for call in self.calls]


def exchange(router: Any = None) -> tuple[Exchange, CallLog, Any]:
    log = CallLog()
    router = router or PickFirst()
    server = ExternalProcessor(
        lambda: router, lambda: Snapshot(PODS), log, ServingSettings(in_flight_expiry_seconds=0)
    )
    return Exchange(server, tuple), log, router


def routed(ex: Exchange) -> None:
    for message in (request_headers(), request_body(BODY)):
        assert ex.handle(message) is not None
        ex.reply_sent()
    assert ex.state is State.ROUTED


def test_a_routed_exchange_goes_through_its_states_and_telemetry_in_order() -> None:
    ex, log, _ = exchange()
    assert ex.state is State.READING
    ex.handle(request_headers())
    ex.reply_sent()
    assert ex.state is State.READING
    assert ex.handle(request_body(BODY)) is not None
    assert ex.state is State.DECIDED
    assert log.names() == ["start"]  # nothing recorded before the reply is out
    assert PODS[0].in_flight == 1
    ex.reply_sent()
    assert ex.state is State.ROUTED
    assert log.names() == ["start", "after_reply"]
    ex.handle(response_headers(200))
    ex.reply_sent()
    assert ex.state is State.RESPONDING
    assert ex.handle(response_body(b"{}", end_of_stream=True)) is None  # no reply: status OK
    assert ex.state is State.ENDED
    assert PODS[0].in_flight == 0
    assert log.calls[1:] == [
        ("after_reply", None),
        ("response_headers", 200),
        ("end", True),
    ]
    ex.close()  # the stream's end changes nothing more
    assert len(log.calls) == 4


def test_an_error_answer_is_recorded_only_once_its_reply_is_out_decision_first() -> None:
    shed = Decision(Outcome.SHED, "p", "1", "m", reason="busy")
    ex, log, _ = exchange(PickFirst(decision=shed))
    ex.handle(request_headers())
    ex.reply_sent()
    assert ex.handle(request_body(BODY)) is not None  # the 429
    assert ex.state is State.ANSWERED
    assert log.names() == ["start"]  # ended, but its reply is not out yet
    ex.reply_sent()
    assert ex.state is State.ENDED
    assert log.calls[1:] == [("after_reply", None), ("response_headers", 429), ("end", True)]


def test_a_stream_gone_before_the_reply_went_out_aborts_and_records_in_order() -> None:
    ex, log, _ = exchange()
    ex.handle(request_headers())
    ex.reply_sent()
    ex.handle(request_body(BODY))
    assert ex.state is State.DECIDED and PODS[0].in_flight == 1
    ex.close(reset=True)
    assert ex.state is State.ABORTED and PODS[0].in_flight == 0
    assert log.calls[1:] == [
        ("stream_error", "aborted", "decided"),
        ("after_reply", None),
        ("end", False),
    ]


def test_a_reset_after_the_end_is_counted_as_such() -> None:
    ex, log, _ = exchange()
    routed(ex)
    ex.handle(response_headers(200, end_of_stream=True))
    assert ex.state is State.ENDED
    ex.close(reset=True)
    assert ex.state is State.ENDED
    assert log.calls[-1] == ("stream_error", "reset", "after_end")


def test_an_answer_whose_reply_never_went_out_is_over_all_the_same() -> None:
    shed = Decision(Outcome.SHED, "p", "1", "m", reason="busy")
    ex, log, _ = exchange(PickFirst(decision=shed))
    ex.handle(request_headers())
    ex.reply_sent()
    ex.handle(request_body(BODY))
    ex.close(reset=True)  # cancelled while the answer was being sent
    assert ex.state is State.ENDED
    assert log.names() == ["start", "stream_error", "after_reply", "response_headers", "end"]


class Shadowed(PickFirst):
    """Routes to the first pod; its decisions name a shadow, decided when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[Decision] = []

    def decide(self, request: Request, candidates: Sequence[Pod], prompt: Any = None) -> Decision:
        decision = super().decide(request, candidates)
        decision.shadow_inputs = ShadowInputs(("shadow",), request, candidates, None, 0)
        return decision

    def decide_shadows(self, decision: Decision) -> ShadowReport | None:
        self.asked.append(decision)
        would = Decision(Outcome.ROUTED, "shadow", "2", "m", pod="pod-1")
        return ShadowReport((ShadowResult(would, Agreement.OTHER_POD),), 0.001)


def test_the_exchange_asks_the_router_for_the_shadows_after_the_reply_and_hands_them_on() -> None:
    router = Shadowed()
    ex, log, _ = exchange(router)
    ex.handle(request_headers())
    ex.reply_sent()
    ex.handle(request_body(BODY))
    assert router.asked == []  # not before the reply
    ex.reply_sent()
    (decision,) = router.asked
    assert decision.pod == "pod-0"
    ((name, report),) = log.calls[1:]
    assert name == "after_reply" and report.results[0].decision.policy == "shadow"
    ex.close()
    assert PODS[0].in_flight == 0
