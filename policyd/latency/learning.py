"""The latency models learn from every exchange policyd routed: a telemetry sink.

Beside the spans and metrics (``policyd.telemetry.fanout.combine``), it
keeps each routed request's decision and, at the exchange's end, teaches the
chosen pod's models: the load the decision saw (the pod's scraped fields
then, policyd's in-flight count and queued prefill there) and what the
answer took.

- A streamed answer gives both: TTFT is its first body bytes' time, TPOT
  the rest of the answer over its output tokens but the first.
- A non-streamed answer arrives whole, so it says only the total: once the
  pod's TPOT model is warm, TTFT is learned as the total less the predicted
  decoding (output tokens but the first, at the predicted TPOT); TPOT is
  learned from streamed answers alone.

The uncached prompt tokens are the answer's own count (its ``usage``:
prompt tokens less those the server found cached) when it sent one, else
the request's estimate less the decision's prefix match. An exchange that
did not complete, or did not say how many tokens it produced, teaches
nothing. Learning runs where the serving path settles exchanges: on the
event loop, some tens of microseconds each, so it runs only while ``wanted``
says a policy in force reads the predictions (a policy that starts reading
them finds the pods cold, and they warm up within some 16 answers each).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from policyd.latency.models import COLD, LatencyModels, Outcome, uncached_prompt
from policyd.policy.decision import Decision, ShadowReport
from policyd.policy.decision import Outcome as Routed
from policyd.policy.request import Request
from policyd.telemetry.exchange_end import ExchangeEnd

_NOTHING: Mapping[str, str] = {}


class Learning:
    """A telemetry sink whose spans teach ``models`` the outcome of each routed request."""

    def __init__(self, models: LatencyModels, wanted: Callable[[], bool] = lambda: True) -> None:
        self.models = models
        self.wanted = wanted

    def start(
        self,
        request: Request,
        decision: Decision,
        trace_carrier: Mapping[str, str],
        decision_seconds: float,
    ) -> Lesson:
        if decision.outcome is not Routed.ROUTED or not self.wanted():
            return _NO_LESSON
        return Lesson(self.models, request, decision)

    def stream_error(self, kind: str, code: str) -> None:
        """Nothing to learn from a stream that broke before a decision."""


class Lesson:
    """One request's exchange, learned from when it ends."""

    __slots__ = ("decision", "models", "request")
    upstream_headers: Mapping[str, str] = _NOTHING

    def __init__(self, models: LatencyModels, request: Request, decision: Decision | None) -> None:
        self.models = models
        self.request = request
        self.decision = decision

    def after_reply(self, shadows: ShadowReport | None = None) -> None:
        """Shadows route nothing: nothing to learn from them."""

    def response_headers(self, status: int, seconds_to_headers: float) -> None:
        """Learned from at the end, with the whole answer."""

    def end(self, end: ExchangeEnd) -> None:
        if self.decision is None:
            return
        outcome = outcome_of(self.models, self.request, self.decision, end)
        if outcome is not None:
            self.models.learn(outcome)


def outcome_of(
    models: LatencyModels, request: Request, decision: Decision, end: ExchangeEnd
) -> Outcome | None:
    """What ``end`` teaches about the pod ``decision`` chose (None: nothing)."""
    pod = decision.chosen
    if decision.outcome is not Routed.ROUTED or pod is None or not end.completed:
        return None
    tokens = end.completion_tokens
    if tokens is None or tokens < 1:
        return None
    if end.prompt_tokens is not None:
        uncached = end.prompt_tokens - (end.cached_tokens or 0)
        prompt_tokens = end.prompt_tokens
    else:
        uncached = uncached_prompt(request.prompt_tokens, decision.prefix_match)
        prompt_tokens = request.prompt_tokens
    uncached = max(uncached, 0)
    context = prompt_tokens + tokens // 2
    in_flight = decision.chosen_in_flight
    total_ms = end.duration_seconds * 1000.0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    if request.stream:
        if end.first_body_seconds is None:
            return None
        ttft_ms = end.first_body_seconds * 1000.0
        tpot_s = end.time_per_output_token(streamed=True)
        tpot_ms = tpot_s * 1000.0 if tpot_s else None
    else:
        tpot = models.predict_tpot((pod,), context)[0]
        if tokens == 1:
            ttft_ms = total_ms
        elif tpot != COLD:
            ttft_ms = total_ms - tpot * (tokens - 1)
        if ttft_ms is not None and ttft_ms <= 0.0:
            ttft_ms = None
    queued = decision.chosen_queued_prefill
    return Outcome(pod, in_flight, queued, uncached, context, ttft_ms, tpot_ms)


_NO_LESSON: Final = Lesson(LatencyModels(), Request(model=""), None)  # teaches nothing
