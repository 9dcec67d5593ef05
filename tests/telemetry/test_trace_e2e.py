"""One request, one trace: the real Envoy, policyd and a pod, joined in the test's collector.

Envoy runs with its OpenTelemetry tracer (``policyd envoy-config
--otlp-endpoint``) and policyd exports OTLP/gRPC (``build_telemetry``), both
to ``OtlpCollector``, a real OTLP trace receiver inside the test. The router
is the real ``Router`` over a real policy file with a shadow policy; the pods
are the e2e harness's test upstreams (real HTTP on loopback), which record the
``traceparent`` they receive.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio
import yaml
from e2e_support import SSE_USAGE, TestUpstream, free_port
from extproc_support import Snapshot, settled
from otlp_collector import OtlpCollector, ReceivedSpan
from telemetry_support import write_policies

from policyd.extproc.envoy_config import EnvoyConfigOptions, bootstrap
from policyd.extproc.envoy_process import EnvoyProcess
from policyd.extproc.server import ExtProcServer, ServerOptions
from policyd.policy import PolicyStore, Router
from policyd.pool.pod import Pod
from policyd.telemetry import DecisionTelemetry, build_telemetry
from policyd.telemetry import attributes as a

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

ENVOY_SERVICE = "envoy-inference-gateway"
SPAN_KIND_SERVER = 2


@dataclass
class TracedGateway:
    url: str
    collector: OtlpCollector
    upstreams: dict[str, TestUpstream]
    telemetry: DecisionTelemetry
    client: aiohttp.ClientSession
    server: ExtProcServer


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TracedGateway]:
    tmp = tmp_path_factory.mktemp("traced")
    collector = OtlpCollector()
    await collector.start()
    upstreams = {name: TestUpstream(name) for name in ("pod-a", "pod-b")}
    for upstream in upstreams.values():
        await upstream.start()
    snapshot = Snapshot(tuple(Pod(name, u.address) for name, u in upstreams.items()))
    router = Router(PolicyStore.open(write_policies(tmp)))
    telemetry = build_telemetry(otlp_endpoint=collector.endpoint)
    server = ExtProcServer(
        lambda: router,
        lambda: snapshot,
        telemetry=telemetry,
        options=ServerOptions(port=0, grace_seconds=0.5),
    )
    await server.start()
    listen, admin = free_port(), free_port()
    options = EnvoyConfigOptions(
        port=listen, admin_port=admin, policyd_port=server.port, otlp_endpoint=collector.endpoint
    )
    config = bootstrap(options)
    # Envoy batches spans for 5 s by default; the test wants them at once.
    config["layered_runtime"] = {
        "layers": [
            {
                "name": "test",
                "static_layer": {
                    "tracing.opentelemetry.flush_interval_ms": 100,
                    "tracing.opentelemetry.min_flush_spans": 1,
                },
            }
        ]
    }
    (tmp / "envoy.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    envoy = EnvoyProcess(tmp / "envoy.yaml", admin, log_file=tmp / "envoy.log")
    envoy.start()
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    try:
        await envoy.wait_ready()
        yield TracedGateway(
            f"http://127.0.0.1:{listen}", collector, upstreams, telemetry, client, server
        )
    finally:
        envoy.stop()
        await client.close()
        await server.stop(0)
        telemetry.shutdown()
        for upstream in upstreams.values():
            await upstream.stop()
        await collector.stop()


async def flush(gateway: TracedGateway) -> None:
    """Export policyd's finished spans now (off the loop: the collector runs on it)."""
    tracer = gateway.telemetry.tracer
    assert tracer is not None
    await settled(gateway.server)  # spans end a few milliseconds after the response
    await asyncio.to_thread(tracer.force_flush)


async def test_one_request_is_one_trace_from_envoy_through_policyd_to_the_pod(
    gateway: TracedGateway,
) -> None:
    for upstream in gateway.upstreams.values():
        upstream.release_stream.clear()
    body = {"model": "llama", "prompt": "hello", "stream": True, "max_tokens": 3}
    async with gateway.client.post(gateway.url + "/v1/completions", json=body) as response:
        assert response.status == 200
        served_by = response.headers["x-test-upstream"]
        first = await response.content.readuntil(b"\n\n")
        assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "Hel"
        # The response is still streaming: the decision span is not finished yet.
        await flush(gateway)
        assert gateway.collector.of("policyd") == []
        gateway.upstreams[served_by].release_stream.set()
        rest = await response.read()
    assert rest.endswith(b"data: [DONE]\n\n")

    await flush(gateway)
    (decision,) = gateway.collector.of("policyd")
    await gateway.collector.wait_for(ENVOY_SERVICE)
    trace_id = decision.trace_id
    envoy_spans = [s for s in gateway.collector.of(ENVOY_SERVICE) if s.trace_id == trace_id]
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
    assert {e.name for e in decision.span.events} == {a.NODE_EVENT, a.SHADOW_EVENT}
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
