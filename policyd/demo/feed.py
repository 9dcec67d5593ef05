"""The demo's window on policyd's decisions: a ``Telemetry`` that keeps them for display.

The serving path reports every decision through the ``Telemetry`` protocol
(``policyd.extproc.interfaces``): ``start`` when the router has decided, then
the response status and, at the end, the time to first body byte and the
token usage. Production wires OpenTelemetry there; the demo keeps a record
per request that the view reads.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from policyd.policy.decision import Decision, NodeTrace, Outcome, ShadowReport
from policyd.policy.request import Request
from policyd.telemetry.exchange_end import ExchangeEnd

LABEL_HEADER: Final = "x-demo-request"  # the demo client's name for a request


@dataclass(slots=True)
class DecisionRecord:
    """One request as policyd saw it, filled in as its response arrives."""

    label: str
    model: str
    criticality: str
    stream: bool
    outcome: Outcome
    pod: str
    why: str
    status: int | None = None
    first_body_seconds: float | None = None
    completion_tokens: int | None = None
    prefix_match: float | None = None  # the chosen pod's, for a policy that reads it
    prompt_tokens: int | None = None  # as the pod counted them
    cached_tokens: int | None = None  # of those, served from its prefix cache
    duration_seconds: float | None = None
    completed: bool | None = None  # None while the response is still on its way

    @property
    def done(self) -> bool:
        return self.completed is not None


def explain(decision: Decision) -> str:
    """Why the request went where it went, in a few words.

    The filter nodes that narrowed the candidates (``name in→kept``; a node
    that kept none hands its input on, ``name: none of N``), then how the
    pick was made; for an answer policyd gave itself, its reason.
    """
    if decision.outcome is not Outcome.ROUTED:
        return decision.reason or decision.outcome.value
    steps = [_step(node) for node in decision.trace if _narrowed(node)]
    survivors = len(decision.survivors)
    if decision.score is not None:
        pick = f"best score {decision.score:.2f} of {survivors}"
    elif survivors > 1:
        pick = f"random of {survivors}"
    else:
        pick = "the only one left"
    first = decision.trace[0].candidates_in if decision.trace else survivors
    if not steps:
        return f"all {first} pass · {pick}"
    return " > ".join(steps) + f" · {pick}"


def _narrowed(node: NodeTrace) -> bool:
    return node.narrows and len(node.kept) < node.candidates_in


def _step(node: NodeTrace) -> str:
    if not node.kept:  # a failed node hands its whole input on (on_failure / next)
        return f"{node.node}: none of {node.candidates_in}"
    return f"{node.node} {node.candidates_in}→{len(node.kept)}"


class DemoSpan:
    """The ``RequestSpan`` of one request: writes into its record."""

    __slots__ = ("_feed", "record")

    upstream_headers: Mapping[str, str] = {}

    def __init__(self, feed: DecisionFeed, record: DecisionRecord) -> None:
        self._feed = feed
        self.record = record

    def after_reply(self, shadows: ShadowReport | None = None) -> None:
        return None

    def response_headers(self, status: int, seconds_to_headers: float) -> None:
        self.record.status = status

    def end(self, end: ExchangeEnd) -> None:
        record = self.record
        record.prompt_tokens = end.prompt_tokens
        record.cached_tokens = end.cached_tokens
        record.completed = end.completed
        record.duration_seconds = end.duration_seconds
        record.first_body_seconds = end.first_body_seconds
        record.completion_tokens = end.completion_tokens
        if record.status is None:
            record.status = record.outcome.http_status
        self._feed.finished(record)


@dataclass
class Totals:
    """Counts over the whole run (the table shows only the latest rows)."""

    finished: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    by_pod: Counter[str] = field(default_factory=Counter)
    by_model_pod: Counter[tuple[str, str]] = field(default_factory=Counter)
    stream_ttft_seconds: list[float] = field(default_factory=list)  # streamed requests
    completion_tokens: int = 0
    prompt_tokens: int = 0  # of responses that said how many were cached
    cached_tokens: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # answered before any decision


class DecisionFeed:
    """Keeps the latest ``keep`` decisions and running totals; a ``Telemetry``."""

    def __init__(self, keep: int = 200) -> None:
        self.records: deque[DecisionRecord] = deque(maxlen=keep)
        self.done: deque[DecisionRecord] = deque(maxlen=keep)  # in the order they ended
        self.totals = Totals()

    def start(
        self,
        request: Request,
        decision: Decision,
        trace_carrier: Mapping[str, str],
        decision_seconds: float,
    ) -> DemoSpan:
        record = DecisionRecord(
            label=request.headers.get(LABEL_HEADER, request.id[:8]),
            model=request.model,
            criticality=decision.criticality or request.criticality,
            stream=request.stream,
            outcome=decision.outcome,
            pod=decision.pod,
            why=explain(decision),
            prefix_match=decision.prefix_match,
        )
        self.records.append(record)
        totals = self.totals
        if decision.outcome is Outcome.ROUTED:
            totals.by_pod[decision.pod] += 1
            totals.by_model_pod[request.model, decision.pod] += 1
        return DemoSpan(self, record)

    def stream_error(self, kind: str, code: str) -> None:
        """A request answered before any decision (bad JSON, ...): counted by code."""
        if kind == "rejected":
            self.totals.rejected[code] += 1

    def finished(self, record: DecisionRecord) -> None:
        self.done.append(record)
        totals = self.totals
        totals.finished += 1
        if record.status is not None:
            totals.by_status[record.status] += 1
        if record.stream and record.first_body_seconds is not None and record.completed:
            totals.stream_ttft_seconds.append(record.first_body_seconds)
        totals.completion_tokens += record.completion_tokens or 0
        if record.prompt_tokens is not None and record.cached_tokens is not None:
            totals.prompt_tokens += record.prompt_tokens
            totals.cached_tokens += record.cached_tokens
