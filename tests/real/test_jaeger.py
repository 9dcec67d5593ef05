"""Jaeger v2, run with ``telemetry/jaeger.yaml``'s configuration, keeps policyd's spans.

The real ``jaeger`` binary (``real-tools.sh jaeger``: Jaeger v2.13) starts with
the shipped configuration, reports healthy, takes spans over OTLP/gRPC from
policyd's own exporter and from the real Envoy, and returns them from the
query API the docs name (``/api/v3/traces``) with the times they were sent with.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from jaeger_process import Jaeger, get_json
from telemetry_support import pods, request, router_for
from traced_gateway import ENVOY_SERVICE, traced_gateway

from policyd.telemetry import attributes as a
from policyd.telemetry import build_telemetry
from policyd.telemetry.exchange_end import ExchangeEnd

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass(frozen=True)
class Span:
    """A span as ``/api/v3`` returns it (OTLP JSON)."""

    service: str
    raw: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.raw["name"])

    @property
    def trace_id(self) -> str:
        return str(self.raw["traceId"])

    @property
    def span_id(self) -> str:
        return str(self.raw["spanId"])

    @property
    def parent_id(self) -> str:
        return str(self.raw.get("parentSpanId", ""))

    @property
    def start(self) -> int:
        return int(self.raw["startTimeUnixNano"])

    @property
    def end(self) -> int:
        return int(self.raw["endTimeUnixNano"])

    @property
    def attributes(self) -> dict[str, Any]:
        return {kv["key"]: _value(kv["value"]) for kv in self.raw.get("attributes", ())}


def _value(value: dict[str, Any]) -> Any:
    ((kind, content),) = value.items()
    if kind == "intValue":
        return int(content)
    if kind == "arrayValue":
        return tuple(_value(v) for v in content.get("values", ()))
    return content


def spans_of(answer: Any) -> list[Span]:
    """Every span in an ``/api/v3/traces`` answer, with its service name."""
    found = []
    for resource_spans in answer["result"]["resourceSpans"]:
        resource = resource_spans.get("resource", {}).get("attributes", ())
        service = next(
            (kv["value"]["stringValue"] for kv in resource if kv["key"] == "service.name"), ""
        )
        for scope_spans in resource_spans.get("scopeSpans", ()):
            found.extend(Span(service, raw) for raw in scope_spans.get("spans", ()))
    return found


async def poll(
    fetch: Callable[[], tuple[int, Any]], ready: Callable[[list[Span]], bool]
) -> list[Span]:
    """Ask Jaeger until its answer holds what ``ready`` wants (spans are written in batches)."""
    status, answer = 0, None
    for _ in range(100):
        status, answer = await asyncio.to_thread(fetch)
        if status == 200 and ready(spans_of(answer)):
            return spans_of(answer)
        await asyncio.sleep(0.1)
    raise AssertionError(f"Jaeger answered {status}: {json.dumps(answer)[:2000]}")


async def test_the_shipped_config_serves_the_v3_query_api(jaeger: Jaeger) -> None:
    status, answer = await asyncio.to_thread(get_json, f"{jaeger.query}/api/v3/services")
    assert status == 200, answer
    assert "services" in answer or answer == {}


async def test_a_decision_span_sent_over_otlp_comes_back_from_api_v3(
    jaeger: Jaeger, tmp_path: Path
) -> None:
    telemetry = build_telemetry(otlp_endpoint=jaeger.otlp_grpc)
    assert telemetry.tracer is not None
    since = time.time_ns() - 1_000_000_000
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry.start(request(), decision, {}, 0.002)
    record.after_reply(router.decide_shadows(decision))
    record.response_headers(200, 0.01)
    record.end(
        ExchangeEnd(
            completed=True,
            duration_seconds=0.25,
            first_body_seconds=0.05,
            prompt_tokens=12,
            completion_tokens=7,
        )
    )
    await asyncio.to_thread(telemetry.tracer.force_flush)
    telemetry.shutdown()
    until = time.time_ns() + 1_000_000_000

    found = await poll(lambda: jaeger.traces("policyd", since, until), bool)
    (span,) = [s for s in found if s.service == "policyd"]
    assert span.name == "chat llama"
    attributes = span.attributes
    assert attributes[a.POD] == "a"
    assert attributes[a.OUTCOME] == "routed"
    assert attributes[a.HTTP_STATUS] == 200
    assert attributes[a.GEN_AI_OUTPUT_TOKENS] == 7
    # Kept as sent: the decision (2 ms), then the response (250 ms).
    assert span.end - span.start == 252_000_000
    # And by its trace id.
    (again,) = await poll(lambda: jaeger.trace(span.trace_id), bool)
    assert again.span_id == span.span_id


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway_to_jaeger(
    jaeger: Jaeger, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Any]:
    async with traced_gateway(tmp_path_factory.mktemp("traced"), jaeger.otlp_grpc) as gateway:
        yield gateway


async def test_a_request_through_envoy_is_one_trace_in_jaeger(
    jaeger: Jaeger, gateway_to_jaeger: Any
) -> None:
    gateway = gateway_to_jaeger
    body = {"model": "llama", "prompt": "hello", "stream": True, "max_tokens": 3}
    for upstream in gateway.upstreams.values():
        upstream.release_stream.set()
    async with gateway.client.post(gateway.url + "/v1/completions", json=body) as response:
        assert response.status == 200
        traceparent = (
            gateway.upstreams[response.headers["x-test-upstream"]]
            .received[-1]
            .headers["traceparent"]
        )
        await response.read()
    await gateway.flush()
    trace_id = traceparent.split("-")[1]

    def whole(spans: list[Span]) -> bool:
        services = {s.service for s in spans}
        return "policyd" in services and sum(s.service == ENVOY_SERVICE for s in spans) >= 2

    spans = await poll(lambda: jaeger.trace(trace_id), whole)
    (decision,) = [s for s in spans if s.service == "policyd"]
    by_id = {s.span_id: s for s in spans}
    enclosing = []
    current = decision
    while current.parent_id in by_id:
        current = by_id[current.parent_id]
        enclosing.append(current)
    assert [s.service for s in enclosing] == [ENVOY_SERVICE] * len(enclosing)
    assert len(enclosing) >= 2, [s.name for s in spans]  # the ext_proc call, the request
    status, answer = await asyncio.to_thread(get_json, f"{jaeger.query}/api/v3/services")
    assert status == 200
    assert {"policyd", ENVOY_SERVICE} <= set(answer["services"])
    # Jaeger has the decision within Envoy's spans as sent: nothing for a skew fix-up.
    for outer in enclosing:
        assert outer.start <= decision.start and decision.end <= outer.end, (
            decision.name,
            decision.start - outer.start,
            decision.end - outer.end,
            outer.name,
        )
