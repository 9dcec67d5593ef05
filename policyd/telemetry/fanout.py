"""Several telemetry sinks behind one: ``combine(policyd_telemetry, demo_feed)``.

The serving path takes one ``Telemetry``; a demo or an embedding program that
wants its own feed of decisions next to policyd's spans and metrics combines
them here. A sink that raises is logged and does not stop the others. The
trace headers sent upstream are the first sink's that has any.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from policyd.policy.decision import Decision, ShadowReport
from policyd.policy.request import Request
from policyd.telemetry.exchange_end import ExchangeEnd

log = logging.getLogger(__name__)


class SpanLike(Protocol):
    """``policyd.extproc.interfaces.RequestSpan``."""

    @property
    def upstream_headers(self) -> Mapping[str, str]: ...
    def after_reply(self, shadows: ShadowReport | None = None) -> None: ...
    def response_headers(self, status: int, seconds_to_headers: float) -> None: ...
    def end(self, end: ExchangeEnd) -> None: ...


class TelemetryLike(Protocol):
    """``policyd.extproc.interfaces.Telemetry``."""

    def start(
        self,
        request: Request,
        decision: Decision,
        trace_carrier: Mapping[str, str],
        decision_seconds: float,
    ) -> SpanLike: ...
    def stream_error(self, kind: str, code: str) -> None: ...


def combine(*sinks: TelemetryLike) -> TelemetryLike:
    """One telemetry that feeds every sink (the sink itself when there is one)."""
    if len(sinks) == 1:
        return sinks[0]
    return Fanout(sinks)


def _each(targets: Sequence[Any], call: Callable[[Any], object]) -> None:
    for target in targets:
        try:
            call(target)
        except Exception:
            log.exception("telemetry sink %s failed", type(target).__name__)


class Fanout:
    def __init__(self, sinks: Sequence[TelemetryLike]) -> None:
        self.sinks = tuple(sinks)

    def start(
        self,
        request: Request,
        decision: Decision,
        trace_carrier: Mapping[str, str],
        decision_seconds: float,
    ) -> FanoutSpan:
        spans: list[SpanLike] = []
        _each(
            self.sinks,
            lambda sink: spans.append(
                sink.start(request, decision, trace_carrier, decision_seconds)
            ),
        )
        return FanoutSpan(spans)

    def stream_error(self, kind: str, code: str) -> None:
        _each(self.sinks, lambda sink: sink.stream_error(kind, code))


class FanoutSpan:
    def __init__(self, spans: Sequence[SpanLike]) -> None:
        self.spans = tuple(spans)
        headers: Mapping[str, str] = {}
        for span in self.spans:
            try:
                headers = span.upstream_headers
            except Exception:
                log.exception("telemetry sink %s failed", type(span).__name__)
            if headers:
                break
        self.upstream_headers = headers

    def after_reply(self, shadows: ShadowReport | None = None) -> None:
        _each(self.spans, lambda span: span.after_reply(shadows))

    def response_headers(self, status: int, seconds_to_headers: float) -> None:
        _each(self.spans, lambda span: span.response_headers(status, seconds_to_headers))

    def end(self, end: ExchangeEnd) -> None:
        _each(self.spans, lambda span: span.end(end))
