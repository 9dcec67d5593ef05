"""One request's telemetry, from the decision to the end of its response.

``DecisionTelemetry`` is what the serving path calls (the ``Telemetry``
protocol of ``policyd.extproc.interfaces``); it combines up to three sinks,
each optional: OpenTelemetry spans, Prometheus metrics, the decision log.

The work is split by what the live reply needs:

- ``start`` (before the reply): open the span, parented on the trace context
  Envoy sent (else the client's, else a new root), and make the
  ``traceparent`` that goes to the model server; decide whether the decision
  log samples this request. Nothing else.
- ``after_reply(shadows)`` (the reply has been handed to gRPC): put the
  decision's attributes and one event per shadow policy on the span, count
  the decision in the metrics, build the decision-log entry. The shadows come
  decided (``ShadowReport``): telemetry only records them.
- ``response_headers`` / ``end``: the response's status, time to first token,
  token usage and duration; then the span ends, the response is counted and
  the log entry is written. The span's end time is the exchange's end (the
  decision plus ``duration_seconds``), not the time ``end`` is called.

When each is called is the serving path's to decide, not this module's: the
exchange (``policyd.extproc.exchange``) calls ``after_reply``, then
``response_headers`` and ``end``, each once and in that order, a few
milliseconds after the replies (``policyd/extproc/settlement.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

from opentelemetry.sdk.trace import Event
from opentelemetry.trace import (
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from policyd.fields import POD_FIELDS
from policyd.policy.decision import Decision, Outcome, ShadowReport, ShadowResult
from policyd.policy.request import Request
from policyd.telemetry import attributes as a
from policyd.telemetry.decision_log import DecisionLog
from policyd.telemetry.exchange_end import ExchangeEnd
from policyd.telemetry.metrics import DecisionMetrics, FlowMetrics
from policyd.telemetry.tracing import DecisionTracer, StartedSpan

log = logging.getLogger(__name__)

_EMPTY: Final[Mapping[str, str]] = {}
_UNSET: Final = Status()
_FLAGS: Final = [f"{flags:02x}" for flags in range(256)]  # traceparent's last field


class DecisionTelemetry:
    """Spans, metrics and the decision log for every decision; each part optional.

    ``span_usage``: whether the decision span carries the response's
    ``gen_ai.usage.*`` counts. A model server that traces too (vLLM with
    ``--otlp-traces-endpoint``) puts the same counts on its own span, the
    decision span's child; a pipeline that sums ``gen_ai.usage.*`` over spans
    (a span-metrics connector) then counts each token twice unless one side
    leaves them out (``policyd serve --span-usage off``).
    """

    def __init__(
        self,
        *,
        tracer: DecisionTracer | None = None,
        metrics: DecisionMetrics | None = None,
        decision_log: DecisionLog | None = None,
        span_usage: bool = True,
    ) -> None:
        self.tracer = tracer
        self.metrics = metrics
        self.decision_log = decision_log
        self.span_usage = span_usage

    def shutdown(self) -> None:
        """Export the spans still queued and write the log entries still queued."""
        if self.tracer is not None:
            self.tracer.shutdown()
        if self.decision_log is not None:
            self.decision_log.close()

    def start(
        self,
        request: Request,
        decision: Decision,
        trace_carrier: Mapping[str, str],
        decision_seconds: float,
    ) -> RequestRecord:
        return RequestRecord(self, request, decision, trace_carrier, decision_seconds)

    def stream_error(self, kind: str, code: str) -> None:
        if self.metrics is not None:
            self.metrics.stream_error(kind, code)

    @property
    def flow(self) -> FlowMetrics | None:
        """Where flow control reports its held requests and their outcomes."""
        return self.metrics.flow if self.metrics is not None else None


class RequestRecord:
    """The ``RequestSpan`` of one request (see the module docstring for the phases)."""

    __slots__ = (
        "_attributes",
        "_carrier",
        "_decided_ns",
        "_decision",
        "_entry",
        "_owner",
        "_request",
        "_seconds",
        "_shadow_events",
        "_span",
        "_span_status",
        "_status",
        "_to_headers",
        "upstream_headers",
    )

    def __init__(
        self,
        owner: DecisionTelemetry,
        request: Request,
        decision: Decision,
        carrier: Mapping[str, str],
        decision_seconds: float,
    ) -> None:
        self._owner = owner
        self._request = request
        self._decision = decision
        self._carrier = carrier
        self._seconds = decision_seconds
        now_ns = time.time_ns()
        self._decided_ns = now_ns
        self._status = 0
        self._to_headers: float | None = None
        self._span: StartedSpan | None = None
        # The span's parts, made by _annotate: its attributes (the response's
        # added at the end) and its shadow events.
        self._attributes: dict[str, Any] = {}
        self._shadow_events: list[Event] = []
        self._span_status = _UNSET
        self.upstream_headers: Mapping[str, str] = _EMPTY
        tracer = owner.tracer
        if tracer is not None:
            span = tracer.start(
                a.decision_span_name(request.path, request.model),
                _parent(carrier),
                now_ns - int(decision_seconds * 1e9),
            )
            self._span = span
            self.upstream_headers = _trace_headers(span)
        log_ = owner.decision_log
        self._entry: dict[str, Any] | None = {} if log_ is not None and log_.sampled() else None

    # -- after the reply ----------------------------------------------------------------

    def after_reply(self, shadows: ShadowReport | None = None) -> None:
        results = shadows.results if shadows is not None else ()
        decision = self._decision
        metrics = self._owner.metrics
        if metrics is not None:
            metrics.decision(decision, self._seconds)
            if shadows is not None:
                metrics.shadows(decision.policy, results, shadows.seconds)
        if self._span is not None and self._span.recording:
            self._annotate(results, shadows is not None)
        if self._entry is not None:
            self._entry.update(self._log_decision(results))

    def _annotate(self, shadows: tuple[ShadowResult, ...], shadowed: bool) -> None:
        decision = self._decision
        request = self._request
        criticality = decision.criticality or request.criticality
        operation, provider = a.operation(request.path)
        attributes: dict[str, Any] = {
            a.GEN_AI_OPERATION: operation,
            a.GEN_AI_PROVIDER: provider,
            a.GEN_AI_REQUEST_MODEL: a.clip(request.model),
            a.POLICY: decision.policy,
            a.POLICY_VERSION: decision.policy_version,
            a.TARGET_MODEL: a.clip(decision.target_model),
            a.CRITICALITY: criticality,
            a.OUTCOME: decision.outcome.value,
            a.PROMPT_TOKENS: request.prompt_tokens,
            a.CANDIDATES: decision.candidate_count,
            a.SURVIVORS: len(decision.survivors),
            a.DECISION_DURATION: self._seconds,
        }
        if request.stream:
            attributes[a.GEN_AI_REQUEST_STREAM] = True
        if request.id:
            attributes[a.REQUEST_ID] = a.clip(request.id)
        if request.max_tokens:
            attributes[a.GEN_AI_REQUEST_MAX_TOKENS] = request.max_tokens
        if decision.reason:
            attributes[a.REASON] = a.clip(decision.reason)
        if decision.outcome is Outcome.ROUTED:
            host, port = a.split_endpoint(decision.endpoint)
            attributes[a.SERVER_ADDRESS] = host
            if port is not None:
                attributes[a.SERVER_PORT] = port
            attributes[a.POD] = decision.pod
            attributes[a.ENDPOINT] = decision.endpoint
            if decision.fallbacks:
                attributes[a.FALLBACKS] = decision.fallbacks[: a.MAX_LISTED_PODS]
            if decision.score is not None:
                attributes[a.SCORE] = decision.score
            if decision.prefix_match is not None:
                attributes[a.PREFIX_MATCH] = decision.prefix_match
            if decision.predicted is not None:
                ttft, tpot = decision.predicted
                if ttft >= 0.0:
                    attributes[a.PREDICTED_TTFT] = ttft
                if tpot >= 0.0:
                    attributes[a.PREDICTED_TPOT] = tpot
        else:
            attributes[a.ERROR_TYPE] = decision.outcome.value
        split = decision.split
        if split is not None:
            attributes[a.PD_SPLIT] = split.split
            attributes[a.PD_REASON] = split.reason
            if split.split:
                attributes[a.PD_PREFILL_POD] = split.pod
                attributes[a.PD_PREFILL_ENDPOINT] = split.endpoint
            if split.trace:
                attributes[a.PD_PREFILL_WALK] = a.walk_summary(split.trace)
            if split.note:
                attributes[a.PD_NOTE] = a.clip(split.note)
        if decision.best_prefix_match is not None:
            attributes[a.BEST_PREFIX_MATCH] = decision.best_prefix_match
        if request.slo_ttft_ms:
            attributes[a.SLO_TTFT] = request.slo_ttft_ms
        if request.slo_tpot_ms:
            attributes[a.SLO_TPOT] = request.slo_tpot_ms
        if decision.held_seconds is not None:
            attributes[a.FLOW_HELD] = decision.held_seconds
            attributes[a.FLOW_QUEUE_POSITION] = decision.queue_position or 0
        if decision.scores:
            top = decision.scores[: a.MAX_LISTED_PODS]
            attributes[a.SCORED_PODS] = tuple([name for name, _ in top])
            attributes[a.SCORED_VALUES] = tuple([score for _, score in top])
        if shadowed:
            attributes[a.SHADOWS] = len(shadows)
            attributes[a.SHADOWS_AGREED] = sum(1 for s in shadows if s.agreement.agrees)
        if decision.trace:
            attributes[a.WALK] = a.walk_summary(decision.trace)
            errors = sum(len(step.errors) for step in decision.trace)
            if errors:
                attributes[a.WALK_ERRORS] = errors
                attributes[a.WALK_FIRST_ERROR] = a.first_error(decision.trace)
        self._attributes = attributes
        if decision.outcome is Outcome.ERROR:
            self._span_status = Status(StatusCode.ERROR, a.clip(decision.reason))
        at = self._decided_ns
        for shadow in shadows:
            would = shadow.decision
            event = {
                a.SHADOW_POLICY: would.policy,
                a.SHADOW_VERSION: would.policy_version,
                a.SHADOW_OUTCOME: would.outcome.value,
                a.SHADOW_AGREEMENT: shadow.agreement.value,
                a.SHADOW_AGREES: shadow.agreement.agrees,
            }
            if would.pod:
                event[a.SHADOW_POD] = would.pod
                event[a.SHADOW_ENDPOINT] = would.endpoint
            if would.reason:
                event[a.SHADOW_REASON] = a.clip(would.reason)
            self._shadow_events.append(Event(a.SHADOW_EVENT, event, at))

    def _log_decision(self, shadows: tuple[ShadowResult, ...]) -> dict[str, Any]:
        decision = self._decision
        request = self._request
        max_pods = self._owner.decision_log.max_pods if self._owner.decision_log else 0
        trace_id, span_id = self._trace_ids()
        pods = decision.candidates
        return {
            "time": datetime.fromtimestamp(self._decided_ns / 1e9, UTC).isoformat(),
            "request_id": a.clip(request.id),
            "trace_id": trace_id,
            "span_id": span_id,
            "policy": decision.policy,
            "policy_version": decision.policy_version,
            "request": {
                "model": a.clip(request.model),
                "target_model": a.clip(decision.target_model),
                "criticality": decision.criticality or request.criticality,
                "path": a.clip(request.path),
                "stream": request.stream,
                "prompt_tokens": request.prompt_tokens,
                "max_tokens": request.max_tokens,
            },
            "candidates": decision.candidate_count,
            "pods": [_pod_inputs(pod) for pod in pods[:max_pods]],
            "pods_omitted": max(len(pods) - max_pods, 0),
            "walk": [
                {
                    "node": step.node,
                    "kind": step.kind,
                    "in": step.candidates_in,
                    "kept": list(step.kept),
                    "errors": [{"pod": pod, "error": a.clip(error)} for pod, error in step.errors],
                    "branch": step.branch,
                    "next": step.next,
                    "note": a.clip(step.note),
                }
                for step in decision.trace
            ],
            "survivors": list(decision.survivors),
            "scores": [{"pod": pod, "score": score} for pod, score in decision.scores],
            "outcome": decision.outcome.value,
            "status": decision.outcome.http_status,
            "reason": a.clip(decision.reason),
            "pod": decision.pod,
            "endpoint": decision.endpoint,
            "fallbacks": list(decision.fallbacks),
            "score": decision.score,
            "prefix_match": decision.prefix_match,
            "best_prefix_match": decision.best_prefix_match,
            "decision_seconds": self._seconds,
            "split": _split_entry(decision),
            "shadows": [
                {
                    "policy": s.decision.policy,
                    "policy_version": s.decision.policy_version,
                    "outcome": s.decision.outcome.value,
                    "pod": s.decision.pod,
                    "agreement": s.agreement.value,
                }
                for s in shadows
            ],
        }

    def _trace_ids(self) -> tuple[str, str]:
        """The decision span's ids, else the trace the request came with, else empty."""
        span = self._span
        if span is not None and span.trace_id and span.span_id:
            return f"{span.trace_id:032x}", f"{span.span_id:016x}"
        parts = self._carrier.get("traceparent", "").split("-")
        return (parts[1], "") if len(parts) == 4 else ("", "")

    # -- the response -------------------------------------------------------------------

    def response_headers(self, status: int, seconds_to_headers: float) -> None:
        self._status = status
        self._to_headers = seconds_to_headers

    def end(self, end: ExchangeEnd) -> None:
        decision = self._decision
        request = self._request
        routed = decision.outcome is Outcome.ROUTED
        metrics = self._owner.metrics
        tpot = end.time_per_output_token(request.stream)
        ttft_met, tpot_met = _objectives_met(request, end, tpot)
        if metrics is not None and routed:
            metrics.response(
                decision.policy,
                decision.target_model,
                self._status,
                completed=end.completed,
                first_body_seconds=end.first_body_seconds,
                duration_seconds=end.duration_seconds,
            )
            if end.completed:
                metrics.latency(
                    decision,
                    ttft=end.first_body_seconds if request.stream else None,
                    tpot=tpot,
                    ttft_met=ttft_met,
                    tpot_met=tpot_met,
                )
        span = self._span
        tracer = self._owner.tracer
        if span is not None and span.recording and tracer is not None:
            attributes = self._attributes
            attributes[a.RESPONSE_COMPLETED] = end.completed
            attributes[a.RESPONSE_DURATION] = end.duration_seconds
            if self._status:
                attributes[a.HTTP_STATUS] = self._status
            if self._to_headers is not None:
                attributes[a.TIME_TO_HEADERS] = self._to_headers
            if end.first_body_seconds is not None:
                attributes[a.TIME_TO_FIRST_TOKEN] = end.first_body_seconds
            if self._owner.span_usage:
                _put_usage(attributes, end)
            if tpot is not None:
                attributes[a.TIME_PER_OUTPUT_TOKEN] = tpot
            if ttft_met is not None:
                attributes[a.SLO_TTFT_MET] = ttft_met
            if tpot_met is not None:
                attributes[a.SLO_TPOT_MET] = tpot_met
            if routed and self._status >= 500:
                attributes[a.ERROR_TYPE] = str(self._status)
                self._span_status = Status(StatusCode.ERROR)
            # The span ends when the exchange did, as the serving path measured it,
            # not now: ``end`` is called milliseconds later, when it is recorded.
            tracer.finish(
                span,
                self._decided_ns + round(end.duration_seconds * 1e9),
                attributes=attributes,
                events=self._shadow_events,
                status=self._span_status,
            )
        entry = self._entry
        decision_log = self._owner.decision_log
        if entry is not None and decision_log is not None:
            entry["response"] = {
                "status": self._status,
                "completed": end.completed,
                "time_to_headers_seconds": self._to_headers,
                "time_to_first_token_seconds": end.first_body_seconds,
                "duration_seconds": end.duration_seconds,
                "prompt_tokens": end.prompt_tokens,
                "completion_tokens": end.completion_tokens,
                "cached_tokens": end.cached_tokens,
            }
            decision_log.write(entry)


def _objectives_met(
    request: Request, end: ExchangeEnd, tpot: float | None
) -> tuple[bool | None, bool | None]:
    """Whether the answer met each objective the client stated (None: none stated, or
    the answer does not say: it did not complete, or a whole answer's pace)."""
    if not end.completed:
        return None, None
    ttft_met = tpot_met = None
    if request.slo_ttft_ms and end.first_body_seconds is not None:
        ttft_met = end.first_body_seconds * 1000.0 <= request.slo_ttft_ms
    if request.slo_tpot_ms and tpot is not None:
        tpot_met = tpot * 1000.0 <= request.slo_tpot_ms
    return ttft_met, tpot_met


def _parent(carrier: Mapping[str, str]) -> SpanContext | None:
    """The context of a W3C ``traceparent``, parsed directly (the hot path's share).

    An absent or malformed header gives ``None``: the span is a root.
    """
    header = carrier.get("traceparent")
    if not header:
        return None
    parts = header.split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    if parts[0] == "ff" or len(parts[0]) != 2 or (parts[0] == "00" and len(parts) != 4):
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    state = carrier.get("tracestate")
    return SpanContext(
        trace_id,
        span_id,
        is_remote=True,
        trace_flags=TraceFlags(flags & 0xFF),
        trace_state=TraceState.from_header([state]) if state else None,
    )


def _put_usage(attributes: dict[str, Any], end: ExchangeEnd) -> None:
    """The response's token usage, as the model server reported it, under GenAI names."""
    if end.prompt_tokens is not None:
        attributes[a.GEN_AI_INPUT_TOKENS] = end.prompt_tokens
    if end.completion_tokens is not None:
        attributes[a.GEN_AI_OUTPUT_TOKENS] = end.completion_tokens
    if end.cached_tokens is not None:
        attributes[a.GEN_AI_CACHED_TOKENS] = end.cached_tokens


def _trace_headers(span: StartedSpan) -> Mapping[str, str]:
    """W3C trace context naming the decision span as the parent of what follows."""
    if not (span.trace_id and span.span_id):
        return _EMPTY  # an id generator's invalid id: nothing to pass on
    headers = {
        "traceparent": f"00-{span.trace_id:032x}-{span.span_id:016x}-{_FLAGS[span.flags & 0xFF]}"
    }
    if span.trace_state:
        headers["tracestate"] = span.trace_state.to_header()
    return headers


# The pod fields the log and the span record, as declared (``Field.logged``).
_LOGGED_POD_FIELDS: Final = tuple((f.name, f.kind) for f in POD_FIELDS if f.logged)


def _pod_inputs(pod: Any) -> dict[str, Any]:
    """What the policy could read of a pod (metrics as of now, just after the decision)."""
    inputs: dict[str, Any] = {}
    for name, kind in _LOGGED_POD_FIELDS:
        value = getattr(pod, name, None)
        if kind == "list<string>":
            inputs[name] = list(value or ())
        elif kind == "duration":
            inputs[name + "_seconds"] = None if value is None else value.seconds()
        else:
            inputs[name] = value
    return inputs


def _split_entry(decision: Decision) -> dict[str, Any] | None:
    """A two-stage policy's split decision for the decision log (None: none was made)."""
    split = decision.split
    if split is None:
        return None
    return {
        "split": split.split,
        "reason": split.reason,
        "note": a.clip(split.note),
        "pod": split.pod,
        "endpoint": split.endpoint,
        "survivors": list(split.survivors),
        "walk": a.walk_summary(split.trace),
    }
