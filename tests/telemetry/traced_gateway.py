"""The real Envoy and policyd, both tracing over OTLP/gRPC to one endpoint.

Envoy runs with its OpenTelemetry tracer (``policyd envoy-config
--otlp-endpoint``) and policyd exports OTLP/gRPC (``build_telemetry``), both to
``otlp_endpoint``: the test's ``OtlpCollector`` in ``test_trace_e2e.py``, the
real Jaeger in ``tests/real``. The router is the real ``Router`` over a real
policy file with a shadow policy; the pods are the e2e harness's test
upstreams (real HTTP on loopback), which record the ``traceparent`` they
receive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml
from e2e_support import TestUpstream, free_port
from extproc_support import Snapshot, settled
from telemetry_support import write_policies

from policyd.extproc.envoy_config import EnvoyConfigOptions, bootstrap
from policyd.extproc.envoy_process import EnvoyProcess
from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.policy import PolicyStore, Router
from policyd.pool.pod import Pod
from policyd.telemetry import DecisionTelemetry, build_telemetry

ENVOY_SERVICE = "envoy-inference-gateway"


@dataclass
class TracedGateway:
    url: str
    upstreams: dict[str, TestUpstream]
    telemetry: DecisionTelemetry
    client: aiohttp.ClientSession
    server: ExtProcServer

    async def flush(self) -> None:
        """Export policyd's finished spans now (off the loop: a collector may run on it)."""
        tracer = self.telemetry.tracer
        assert tracer is not None
        await settled(self.server)  # spans are handed over a few milliseconds after the response
        await asyncio.to_thread(tracer.force_flush)


@asynccontextmanager
async def traced_gateway(tmp: Path, otlp_endpoint: str) -> AsyncIterator[TracedGateway]:
    """Two test upstreams, policyd and Envoy, running until the block ends."""
    upstreams = {name: TestUpstream(name) for name in ("pod-a", "pod-b")}
    for upstream in upstreams.values():
        await upstream.start()
    snapshot = Snapshot(tuple(Pod(name, u.address) for name, u in upstreams.items()))
    router = Router(PolicyStore.open(write_policies(tmp)))
    telemetry = build_telemetry(otlp_endpoint=otlp_endpoint)
    server = ExtProcServer(
        lambda: router,
        lambda: snapshot,
        telemetry=telemetry,
        options=ServerOptions(port=0, grace_seconds=0.5),
    )
    await server.start()
    listen, admin = free_port(), free_port()
    options = EnvoyConfigOptions(
        port=listen, admin_port=admin, policyd_port=server.port, otlp_endpoint=otlp_endpoint
    )
    config = bootstrap(options)
    # Envoy batches spans for 5 s by default; the tests want them at once.
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
        yield TracedGateway(f"http://127.0.0.1:{listen}", upstreams, telemetry, client, server)
    finally:
        envoy.stop()
        await client.close()
        await server.stop(0)
        telemetry.shutdown()
        for upstream in upstreams.values():
            await upstream.stop()
