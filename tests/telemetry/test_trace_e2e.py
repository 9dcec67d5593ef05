"""One request, one trace: the real Envoy, policyd and a pod, joined in the test's collector.

Envoy and policyd both export OTLP/gRPC to ``OtlpCollector``, a real OTLP
trace receiver inside the test (the gateway: ``traced_gateway.py``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
from e2e_support import SSE_USAGE
from otlp_collector import OtlpCollector, ReceivedSpan
from traced_gateway import ENVOY_SERVICE, TracedGateway, traced_gateway

from policyd.telemetry import attributes as a

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

SPAN_KIND_SERVER = 2


@dataclass
class Rig:
    gateway: TracedGateway
    collector: OtlpCollector


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    collector = OtlpCollector()
    await collector.start()
    try:
        async with traced_gateway(tmp_path_factory.mktemp("traced"), collector.endpoint) as gateway:
            yield Rig(gateway, collector)
    finally:
        await collector.stop()


async def test_one_request_is_one_trace_from_envoy_through_policyd_to_the_pod(rig: Rig) -> None:
    gateway, collector = rig.gateway, rig.collector
    for upstream in gateway.upstreams.values():
        upstream.release_stream.clear()
    body = {"model": "llama", "prompt": "hello", "stream": True, "max_tokens": 3}
    async with gateway.client.post(gateway.url + "/v1/completions", json=body) as response:
        assert response.status == 200
        served_by = response.headers["x-test-upstream"]
        first = await response.content.readuntil(b"\n\n")
        assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "Hel"
        # The response is still streaming: the decision span is not finished yet.
        await gateway.flush()
        assert collector.of("policyd") == []
        gateway.upstreams[served_by].release_stream.set()
        rest = await response.read()
    assert rest.endswith(b"data: [DONE]\n\n")

    await gateway.flush()
    (decision,) = collector.of("policyd")
    await collector.wait_for(ENVOY_SERVICE)
    trace_id = decision.trace_id
    envoy_spans = [s for s in collector.of(ENVOY_SERVICE) if s.trace_id == trace_id]
    ingress = [s for s in envoy_spans if s.span.kind == SPAN_KIND_SERVER]
    assert len(ingress) == 1, [s.span.name for s in envoy_spans]
    # policyd's decision span descends from Envoy's ingress span.
    ancestors = _ancestors(decision, [*envoy_spans, decision])
    assert ancestors[-1].span_id == ingress[0].span_id
    # ... and lies within its parent (Envoy's ext_proc call) and the request's span: it
    # ends when the response ended, not when policyd settled its bookkeeping after.
    for enclosing in ancestors:
        assert _within(decision, enclosing), _times(decision, enclosing)

    # The pod saw a traceparent of that same trace.
    received = gateway.upstreams[served_by].received[-1]
    version, pod_trace, _, _ = received.headers["traceparent"].split("-")
    assert (version, pod_trace) == ("00", trace_id)

    attributes = decision.attributes
    assert decision.span.name == "text_completion llama"
    assert attributes[a.GEN_AI_OPERATION] == "text_completion"
    assert attributes[a.GEN_AI_REQUEST_MODEL] == "llama"
    # Envoy, the edge, sets its own request id; policyd's span carries the one the pod got.
    headers = {name.lower(): value for name, value in received.headers.items()}
    assert attributes[a.REQUEST_ID] == headers["x-request-id"]
    assert attributes[a.POLICY] == "live"
    assert len(attributes[a.POLICY_VERSION]) == 12
    assert attributes[a.OUTCOME] == "routed"
    assert attributes[a.POD] == served_by
    host, port = gateway.upstreams[served_by].address.split(":")
    assert (attributes[a.SERVER_ADDRESS], attributes[a.SERVER_PORT]) == (host, int(port))
    assert attributes[a.CANDIDATES] == 2
    assert attributes[a.SHADOWS] == 1
    assert [e.name for e in decision.span.events] == [a.SHADOW_EVENT]
    assert "(keep)" in str(attributes[a.WALK])  # the walk, one attribute
    # The outcome arrived with the end of the response.
    assert attributes[a.HTTP_STATUS] == 200
    assert attributes[a.GEN_AI_INPUT_TOKENS] == SSE_USAGE["prompt_tokens"]
    assert attributes[a.GEN_AI_OUTPUT_TOKENS] == SSE_USAGE["completion_tokens"]
    assert attributes[a.RESPONSE_COMPLETED] is True
    assert 0 < attributes[a.TIME_TO_FIRST_TOKEN] < attributes[a.RESPONSE_DURATION]


def _within(inner: ReceivedSpan, outer: ReceivedSpan) -> bool:
    """Whether ``inner`` starts no earlier and ends no later than ``outer``."""
    return (
        outer.span.start_time_unix_nano <= inner.span.start_time_unix_nano
        and inner.span.end_time_unix_nano <= outer.span.end_time_unix_nano
    )


def _times(inner: ReceivedSpan, outer: ReceivedSpan) -> str:
    """How ``inner`` lies against ``outer``, in microseconds from ``outer``'s start."""
    origin = outer.span.start_time_unix_nano

    def us(ns: int) -> str:
        return f"{(ns - origin) / 1000:+.0f} us"

    return (
        f"{inner.span.name}: {us(inner.span.start_time_unix_nano)}"
        f" .. {us(inner.span.end_time_unix_nano)};"
        f" {outer.span.name}: +0 us .. {us(outer.span.end_time_unix_nano)}"
    )


def _ancestors(span: ReceivedSpan, spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    """``span``'s chain of parents within ``spans``, nearest first."""
    by_id = {s.span_id: s for s in spans}
    chain: list[ReceivedSpan] = []
    current = span
    while current.parent_id and current.parent_id in by_id:
        current = by_id[current.parent_id]
        chain.append(current)
    assert chain, f"no parent of {span.span.name} among {[s.span.name for s in spans]}"
    return chain
