"""What readiness means (docs/serving.md, "Readiness"), on ``policyd serve`` as operators
run it, behind the real Envoy: not ready while no pod is known; ready once the pods are
known and each was scraped once, even when none answers (no candidates); and then each
request gets policyd's own 503 ``no_ready_endpoints``, which says why, rather than the
gateway's ``no_destination`` that an unready policyd would leave it with."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import grpc
import pytest
from e2e_rig import policyd_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import free_port, start_envoy

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

REPO = Path(__file__).resolve().parents[2]


async def until(check: object, what: str, process: subprocess.Popen[str]) -> None:
    """Polls the coroutine function ``check`` until it returns true (30 s at most)."""
    deadline = time.monotonic() + 30
    while not await check():  # type: ignore[operator]
        assert process.poll() is None, "policyd serve exited"
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


async def test_readiness_follows_the_pod_set_not_the_pods_answers(tmp_path: Path) -> None:
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods: []\n")
    port, monitoring, dead = free_port(), free_port(), free_port()  # nothing listens on dead
    command = [
        sys.executable, "-m", "policyd", "serve",
        "--policy", str(REPO / "rules" / "default.yaml"),
        "--pods", str(pods), "--pods-poll-interval", "0.1",
        "--port", str(port), "--monitoring-port", str(monitoring),
        "--scrape-interval", "0.05", "--log-format", "json",
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    options = EnvoyConfigOptions(port=0, admin_port=0, policyd_port=port)
    envoy = await start_envoy(tmp_path, options)
    status_url = f"http://127.0.0.1:{monitoring}"
    try:
        async with (
            aiohttp.ClientSession() as client,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            health = health_pb2_grpc.HealthStub(channel)

            async def answers(path: str) -> int:
                try:
                    async with client.get(status_url + path) as response:
                        return response.status
                except aiohttp.ClientConnectionError:
                    return 0

            async def readiness() -> int:
                request = health_pb2.HealthCheckRequest(service="readiness")
                return int((await health.Check(request, timeout=5)).status)

            async def live() -> bool:
                return await answers("/healthz") == 200

            await until(live, "policyd serve never served /healthz", process)
            # No pod known: not ready, over HTTP and gRPC alike.
            await asyncio.sleep(0.5)  # ten scrape intervals, five pod-file reads
            assert await answers("/readyz") == 503
            assert await readiness() == health_pb2.HealthCheckResponse.NOT_SERVING

            # A pod that refuses every scrape: known and tried, so ready.
            pods.write_text(f"pods:\n  - {{name: dead-0, address: '127.0.0.1:{dead}'}}\n")

            async def ready() -> bool:
                return await answers("/readyz") == 200

            async def serving() -> bool:  # the gRPC health service follows every 0.5 s
                return await readiness() == health_pb2.HealthCheckResponse.SERVING

            await until(ready, "pods known and tried, yet not ready", process)
            await until(serving, "ready over HTTP, not over gRPC", process)
            async with client.get(status_url + "/metrics") as response:
                families = {
                    f.name: f for f in text_string_to_metric_families(await response.text())
                }
            (candidates,) = families["policyd_pool_candidate_pods"].samples
            (known,) = families["policyd_pool_pods"].samples
            assert (known.value, candidates.value) == (1, 0)

            # Envoy health-checks it into its cluster; a request gets policyd's answer.
            async def healthy_in_envoy() -> bool:
                return await policyd_health(client, envoy.admin_port) == "healthy"

            await until(healthy_in_envoy, "Envoy never saw policyd healthy", process)
            body = {"model": "adapter-1", "prompt": "hello", "max_tokens": 3}
            url = f"http://127.0.0.1:{envoy.listen_port}/v1/completions"
            async with client.post(url, json=body) as response:
                status, text = response.status, await response.text()
            assert status == 503, text
            assert json.loads(text)["error"]["code"] == "no_ready_endpoints"

            # The pod set emptied again: not ready.
            pods.write_text("pods: []\n")

            async def unready() -> bool:
                return await answers("/readyz") == 503

            await until(unready, "no pod known, yet still ready", process)
    finally:
        envoy.stop()
        process.terminate()
        process.communicate(timeout=20)
