"""``policyd serve`` as operators run it: a separate process, two workers, the real Envoy
in front, simulated pods behind, stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from policyd.demo.stack import warm_up
from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import free_port, start_envoy
from policyd.sim import SimPool

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

REPO = Path(__file__).resolve().parents[2]


async def wait_ready(port: int, process: subprocess.Popen[str], timeout: float = 30) -> None:
    """Until policyd's gRPC health says ``readiness`` is SERVING."""
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert process.poll() is None, "policyd serve exited during start"
            try:
                answer = await stub.Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=1
                )
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError("policyd serve did not become ready")


async def test_serve_routes_through_envoy_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    async with SimPool(2, base_port=0, time_scale=10) as sim:
        await warm_up(sim.servers)
        pods = tmp_path / "pods.yaml"
        pods.write_text(
            "pods:\n"
            + "".join(f"  - {{name: {s.name}, address: '{s.address}'}}\n" for s in sim.servers)
        )
        port = free_port()
        command = [
            sys.executable, "-m", "policyd", "serve",
            "--policy", str(REPO / "rules" / "default.yaml"), "--pods", str(pods),
            "--port", str(port), "--workers", "2", "--scrape-interval", "0.05",
            "--grace-seconds", "5", "--log-format", "json",
        ]  # fmt: skip
        process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        envoy = None
        try:
            await wait_ready(port, process)
            envoy = await start_envoy(
                tmp_path, EnvoyConfigOptions(port=0, admin_port=0, policyd_port=port)
            )
            url = f"http://127.0.0.1:{envoy.listen_port}/v1/completions"
            body = {"model": "adapter-1", "prompt": "hello", "max_tokens": 3}
            async with aiohttp.ClientSession() as client:
                for _ in range(4):
                    async with client.post(url, json=body) as response:
                        assert response.status == 200, await response.text()
                        assert (await response.json())["usage"]["completion_tokens"] == 3
                served = sum(sum(s.driver.engine.stats.finished.values()) for s in sim.servers)
                assert served == 2 + 4  # the warm-up requests and these

                process.send_signal(signal.SIGTERM)
                _, errors = await asyncio.to_thread(process.communicate, timeout=20)
                assert process.returncode == 0, errors

                async with client.post(url, json=body) as response:
                    assert response.status == 503  # nobody routes any more
        finally:
            if envoy is not None:
                envoy.stop()
            if process.poll() is None:
                process.kill()
                process.wait()

    events = [json.loads(line) for line in errors.splitlines()]  # every line is one JSON event
    assert {"time", "level", "logger", "pid", "message"} <= set(events[0])
    listening = {e["pid"] for e in events if "ext_proc listening on" in e["message"]}
    stopped = {e["pid"] for e in events if e["message"] == "stopped"}
    assert len(listening) == 2
    assert stopped == listening
    assert not [e for e in events if e["level"] == "error"]
