"""What the serving path needs from the other rooms, as small structural types.

The ext_proc servicer depends on three things it does not own:

- the current router (``policy``): read once per request, because policies are
  hot-swapped while requests are in flight;
- the current pool snapshot (``pool``): read once per request, immutable;
- telemetry: a span per routed request, parented on the trace context Envoy
  sent, which also returns the headers that carry the trace to the model
  server and records the response's status, timing and token usage.

They are Protocols so any object with the right shape plugs in: the real
``Router`` and datastore in ``policyd serve``, small doubles in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol

from policyd.policy.decision import Decision, ShadowReport
from policyd.policy.request import Request
from policyd.policy.router import PrefixMatcher
from policyd.pool.pod import Pod, PoolSnapshot
from policyd.telemetry.exchange_end import ExchangeEnd


class RouterLike(Protocol):
    """``policyd.policy.Router``: pure, non-blocking, safe to call concurrently."""

    def decide(
        self, request: Request, candidates: Sequence[Pod], prompt: PrefixMatcher | None = None
    ) -> Decision: ...

    def decide_shadows(self, decision: Decision) -> ShadowReport | None:
        """What the decision's shadow policies would have decided (asked only
        when ``decision.shadow_inputs`` is set, after the live reply went out)."""
        ...


RouterSource = Callable[[], RouterLike]
"""Returns the router in force now (e.g. ``lambda: router``, one ``Router(store)``)."""

SnapshotSource = Callable[[], PoolSnapshot]
"""Returns the newest pool snapshot (e.g. ``pool.snapshot``)."""

Readiness = Callable[[], bool]
"""True once pods and their metrics are loaded; drives the gRPC readiness check."""


class RequestSpan(Protocol):
    """Telemetry for one request that reached a decision."""

    @property
    def upstream_headers(self) -> Mapping[str, str]:
        """Headers to add to the request sent to the model server (``traceparent``)."""
        ...

    def after_reply(self, shadows: ShadowReport | None = None) -> None:
        """The reply carrying the decision has been handed to gRPC.

        Called once, a few milliseconds after that reply went out (or after
        the stream closed, if it never did), with what the policy's shadow
        policies would have decided (None when it has none). Work that must
        not delay the live reply (span attributes, metrics, the decision log)
        runs here. The exchange (``policyd.extproc.exchange``) owns the
        order: ``after_reply`` first, then ``response_headers`` and ``end``,
        each once.
        """
        ...

    def response_headers(self, status: int, seconds_to_headers: float) -> None:
        """The response status arrived; ``seconds_to_headers`` counts from the decision."""
        ...

    def end(self, end: ExchangeEnd) -> None:
        """The exchange is over (called exactly once), as ``end`` says."""
        ...


class Telemetry(Protocol):
    def start(
        self,
        request: Request,
        decision: Decision,
        trace_carrier: Mapping[str, str],
        decision_seconds: float,
    ) -> RequestSpan:
        """A decision was made (routed or not).

        ``trace_carrier`` holds the W3C ``traceparent`` / ``tracestate`` to
        parent the span on: Envoy's own (from the ext_proc stream's gRPC
        metadata) when present, else the client's HTTP headers; empty when
        neither has one. It is worked out when first read, so a sink that
        does not trace should leave it unread. ``decision_seconds`` is how
        long ``decide`` took, so the span can start when the decision did.
        """
        ...

    def stream_error(self, kind: str, code: str) -> None:
        """A request's exchange went wrong outside what a decision records.

        ``kind`` is ``rejected`` (answered with an error before any decision,
        ``code`` the error code, e.g. ``invalid_json``), ``internal`` (an
        exception in policyd while handling a phase, ``code`` the phase) or
        ``aborted`` (the stream ended before the exchange did).
        """
        ...


class NullSpan:
    """A span that records nothing."""

    upstream_headers: Mapping[str, str] = {}

    def after_reply(self, shadows: ShadowReport | None = None) -> None:
        return None

    def response_headers(self, status: int, seconds_to_headers: float) -> None:
        return None

    def end(self, end: ExchangeEnd) -> None:
        return None


NULL_SPAN: Final = NullSpan()


class NoTelemetry:
    """Telemetry that records nothing, for a server built without it."""

    def start(
        self,
        request: Request,
        decision: Decision,
        trace_carrier: Mapping[str, str],
        decision_seconds: float,
    ) -> RequestSpan:
        return NULL_SPAN

    def stream_error(self, kind: str, code: str) -> None:
        return None
