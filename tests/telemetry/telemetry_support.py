"""Shared pieces for the telemetry tests: a real policy, pods, an in-memory span exporter."""

from __future__ import annotations

import random
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from policyd.policy import PolicyStore, Request, Router
from policyd.pool.pod import Pod
from policyd.telemetry import DecisionTelemetry, DecisionTracer
from policyd.telemetry.exchange_end import ExchangeEnd

# The live policy: keep pods with a short queue, prefer free KV cache, one fallback.
LIVE = """
name: live
match:
  models: ["*"]
filters:
  short queue:
    keep: pod.waiting_queue < 10
    on_failure: too busy
  too busy:
    shed: every pod is queueing too much
score:
  free kv cache:
    expr: 1.0 - pod.kv_cache
pick:
  strategy: max-score
  fallbacks: 1
shadows: [fewest-waiting.yaml]
"""

# The shadow: the same filter, but the shortest queue wins.
SHADOW = """
name: fewest-waiting
filters:
  short queue:
    keep: pod.waiting_queue < 10
score:
  short queue:
    expr: 1.0 - double(pod.waiting_queue) / 10.0
"""


def write_policies(directory: Path, live: str = LIVE, shadow: str = SHADOW) -> Path:
    (directory / "fewest-waiting.yaml").write_text(textwrap.dedent(shadow).lstrip())
    path = directory / "live.yaml"
    path.write_text(textwrap.dedent(live).lstrip())
    return path


def router_for(directory: Path, live: str = LIVE, shadow: str = SHADOW) -> Router:
    return Router(PolicyStore.open(write_policies(directory, live, shadow)), rng=random.Random(0))


def pods() -> list[Pod]:
    """Three pods: ``a`` has the freest KV cache, ``b`` the shortest queue, ``c`` is too busy."""
    return [
        Pod("a", "10.0.0.1:8000", waiting_queue=5, kv_cache=0.1),
        Pod("b", "10.0.0.2:8000", waiting_queue=1, kv_cache=0.6),
        Pod("c", "10.0.0.3:8000", waiting_queue=30, kv_cache=0.0),
    ]


def request(**fields: object) -> Request:
    values: dict[str, object] = {
        "model": "llama",
        "id": "req-1",
        "path": "/v1/chat/completions",
        "prompt_tokens": 12,
        "max_tokens": 64,
    }
    values.update(fields)
    return Request(**values)  # type: ignore[arg-type]


def one_request(
    telemetry: DecisionTelemetry,
    directory: Path,
    carrier: dict[str, str],
    asked: Request | None = None,
) -> None:
    """Record one routed request as the serving path does: the decision (the
    live policy over ``pods()``), its shadows after the reply, a 200, the end."""
    asked = request() if asked is None else asked
    router = router_for(directory)
    decision = router.decide(asked, pods())
    record = telemetry.start(asked, decision, carrier, 0.0003)
    record.after_reply(router.decide_shadows(decision))
    record.response_headers(200, 0.02)
    record.end(
        ExchangeEnd(
            completed=True,
            duration_seconds=0.9,
            first_body_seconds=0.1,
            prompt_tokens=12,
            completion_tokens=30,
            cached_tokens=8,
        )
    )


@dataclass
class Spans:
    """A decision tracer exporting synchronously into memory."""

    tracer: DecisionTracer
    exporter: InMemorySpanExporter

    def finished(self) -> tuple[ReadableSpan, ...]:
        return tuple(self.exporter.get_finished_spans())

    def only(self) -> ReadableSpan:
        (span,) = self.finished()
        return span


def in_memory_spans() -> Iterator[Spans]:
    exporter = InMemorySpanExporter()
    tracer = DecisionTracer(processors=[SimpleSpanProcessor(exporter)])
    yield Spans(tracer, exporter)
    tracer.shutdown()
