"""``policyd serve`` as operators run it: a separate process, two workers, the real Envoy
in front, simulated pods behind, stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
import pytest
from e2e_rig import until_serving
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from policyd.demo.stack import warm_up
from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import free_port, start_envoy
from policyd.sim import SimPool

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

REPO = Path(__file__).resolve().parents[2]


async def wait_ready(port: int, process: subprocess.Popen[str], timeout: float = 30) -> None:
    """Until policyd's gRPC health says ``readiness`` is SERVING."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await until_serving(channel, process, timeout)


def two_free_ports() -> int:
    """A port P such that P and P+1 are both free now (the workers' monitoring ports)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two adjacent free ports")


def decisions_counted(text: str, outcome: str | None = "routed") -> float:
    """The decisions one worker's /metrics reports with this outcome (None: any)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "policyd_decisions"
        for sample in family.samples
        if sample.name == "policyd_decisions_total" and outcome in (None, sample.labels["outcome"])
    )


def families_of(text: str) -> dict[str, list[Sample]]:
    """A scrape's samples by sample name."""
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


async def test_serve_routes_through_envoy_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    async with SimPool(2, base_port=0, time_scale=10) as sim:
        await warm_up(sim.servers)
        pods = tmp_path / "pods.yaml"
        pods.write_text(
            "pods:\n"
            + "".join(f"  - {{name: {s.name}, address: '{s.address}'}}\n" for s in sim.servers)
        )
        port = free_port()
        monitoring = two_free_ports()
        command = [
            sys.executable, "-m", "policyd", "serve",
            "--policy", str(REPO / "rules" / "default.yaml"), "--pods", str(pods),
            # The simulated pods share this test's process and event loop, so a
            # burst delays their /metrics; they stay candidates on 2 s old metrics.
            "--port", str(port), "--workers", "2", "--scrape-interval", "0.05",
            "--stale-after", "2",
            "--grace-seconds", "5", "--log-format", "json",
            "--monitoring-port", str(monitoring),
        ]  # fmt: skip
        process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        envoy = None
        try:
            await wait_ready(port, process)
            # Few streams per connection, so that a burst makes Envoy open many
            # connections and the kernel hands some to each worker.
            options = EnvoyConfigOptions(
                port=0, admin_port=0, policyd_port=port, policyd_streams_per_connection=4
            )
            envoy = await start_envoy(tmp_path, options)
            url = f"http://127.0.0.1:{envoy.listen_port}/v1/completions"
            body = {"model": "adapter-1", "prompt": "hello", "max_tokens": 3}
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
                for _ in range(4):
                    async with client.post(url, json=body) as response:
                        assert response.status == 200, await response.text()
                        assert (await response.json())["usage"]["completion_tokens"] == 3
                served = sum(sum(s.driver.engine.stats.finished.values()) for s in sim.servers)
                assert served == 2 + 4  # the warm-up requests and these

                # Each worker serves its own /metrics on the next port; together they
                # counted every routed request once.
                async def per_worker(outcome: str | None) -> list[float]:
                    counts = []
                    for worker_port in (monitoring, monitoring + 1):
                        address = f"http://127.0.0.1:{worker_port}"
                        async with client.get(f"{address}/metrics") as response:
                            assert response.status == 200
                            counts.append(decisions_counted(await response.text(), outcome))
                        async with client.get(f"{address}/readyz") as response:
                            assert response.status == 200
                    return counts

                assert sum(await per_worker("routed")) == 4

                # Each worker reports its own process, its index and the pool's models.
                for worker, worker_port in enumerate((monitoring, monitoring + 1)):
                    async with client.get(f"http://127.0.0.1:{worker_port}/metrics") as response:
                        families = families_of(await response.text())
                    (build,) = families["policyd_build_info"]
                    assert build.labels["worker"] == str(worker)
                    assert families["process_resident_memory_bytes"][0].value > 0
                    assert families["process_start_time_seconds"][0].value > 0
                    models = {s.labels["model_name"] for s in families["policyd_pool_saturation"]}
                    assert models == {sim.servers[0].profile.base_model}
                    assert len(families["policyd_prefix_index_blocks"]) == 2

                # A burst of 160 concurrent requests reaches both workers: at most 4
                # streams share a connection, so Envoy opens 40 or so connections.
                async def one() -> tuple[int, str]:
                    async with client.post(url, json=body) as response:
                        return response.status, await response.text()

                before = await per_worker(None)
                answers = await asyncio.gather(*(one() for _ in range(160)))
                unexpected = [a for a in answers if a[0] not in (200, 429)]
                assert not unexpected, unexpected  # 429: the policy shed some
                for _ in range(1500):  # decisions are counted a few ms after the replies
                    after = await per_worker(None)
                    taken = [a - b for a, b in zip(after, before, strict=True)]
                    if sum(taken) >= 160:
                        break
                    await asyncio.sleep(0.02)
                assert sum(taken) == 160
                assert min(taken) >= 10, taken  # each worker took a share of the burst
                admin = f"http://127.0.0.1:{envoy.admin_port}"
                async with client.get(f"{admin}/clusters") as response:
                    clusters = await response.text()
                assert "policyd::default_priority::max_requests::50000" in clusters

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
