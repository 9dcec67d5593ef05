"""A model-server pod killed under load, through the real Envoy, policyd and simulated pods.

The same load runs twice, on a fresh stack each time: Envoy as ``policyd
envoy-config`` makes it by default (ORIGINAL_DST on the destination header,
no retries), and with ``--model-servers`` (the pods in an override-host
cluster, policyd sending its fallbacks, the route retrying a refused request
on the next pod). A second into the load the pod that served the most goes
away, right after a scrape round: SIGKILL to its process, which resets its
connections and refuses new ones, and policyd keeps naming it for the second
until its next scrape fails.

What a kill costs without retries: the requests the pod was serving, and the
requests policyd sent it before its next scrape failed and dropped it. With
retries, only the first: each request sent to the dead pod is retried, on
the next address policyd named.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from e2e_rig import until

from policyd.extproc.assembly import Policyd
from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import EnvoyProcess, start_envoy
from policyd.extproc.grpc_server import ServerOptions
from policyd.extproc.serving import ServingSettings
from policyd.policy import PolicyStore
from policyd.pool import Pool, ScrapeConfig, StaticFileDiscovery
from policyd.sim import L4_LLAMA2_7B

pytestmark = [pytest.mark.e2e]

POLICYD = [sys.executable, "-m", "policyd"]
# Every pod in turn, so the killed one had a third of the requests; the next two
# pods are the fallbacks policyd sends.
POLICY = """\
name: spread
match:
  models: ["*"]
pick:
  strategy: round-robin
  fallbacks: 2
"""
PODS = 3
TIME_SCALE = 10.0
# istio/deployment.yaml scrapes every 0.1 s; a second, with the kill just after a
# round, gives the dead pod a second of requests whatever the machine's load, so
# that the run without retries surely sends it some.
SCRAPE_INTERVAL = 1.0
RATE = 200.0  # requests a second, sent on a clock whatever the answers
DURATION = 3.0  # at least; and on for DURATION - KILL_AT after the kill, however late
KILL_AT = 1.0
DEADLINE = 60.0  # seconds a loaded machine may take to reach the kill
# Envoy's reset reasons for a connection it could not open.
CONNECT_FAILURES = ("reset reason: connection failure", "reset reason: remote connection failure")


@dataclass
class Sent:
    started: float
    status: int = 0  # 0: the connection failed or was cut
    detail: str = ""


@dataclass
class Run:
    sent: list[Sent] = field(default_factory=list)
    killed_at: float = 0.0
    victim: str = ""
    envoy_stats: dict[str, int] = field(default_factory=dict)

    def failed(self) -> list[Sent]:
        return [s for s in self.sent if s.status != 200]

    def sent_to_a_dead_pod(self) -> list[Sent]:
        """Failed because Envoy could not connect to the pod: it was dead before the
        request reached it. (The pod's requests in flight when it died fail with
        the connection cut; on a starved machine policyd can also miss its
        message timeout. Both count in ``failed``.)"""
        return [s for s in self.failed() if any(r in s.detail for r in CONNECT_FAILURES)]

    def summary(self) -> str:
        kinds = Counter(f"{s.status} {s.detail.rpartition(':')[2]}".strip() for s in self.failed())
        return (
            f"{len(self.sent)} sent, {len(self.failed())} failed, "
            f"{len(self.sent_to_a_dead_pod())} of them sent to the killed {self.victim}: "
            f"{dict(kinds)}; envoy {self.envoy_stats}"
        )


async def send(client: aiohttp.ClientSession, url: str, record: Sent, prompt: str) -> None:
    body = {"model": L4_LLAMA2_7B.base_model, "prompt": prompt, "max_tokens": 8}
    try:
        async with client.post(url + "/v1/completions", json=body) as response:
            text = await response.text()
            record.status = response.status
            if response.status != 200:
                record.detail = text[:200]
    except aiohttp.ClientError as error:
        record.detail = type(error).__name__


async def envoy_counters(envoy: EnvoyProcess, prefix: str) -> dict[str, int]:
    async with (
        aiohttp.ClientSession() as client,
        client.get(f"http://127.0.0.1:{envoy.admin_port}/stats") as response,
    ):
        text = await response.text()
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if name.startswith(prefix) and value.isdigit() and int(value):
            counters[name.removeprefix(prefix)] = int(value)
    return counters


class Pods:
    """Simulated vLLM pods, each its own ``policyd sim`` process, so one can be
    killed outright (SIGKILL: the kernel resets its connections and refuses new ones)."""

    def __init__(self) -> None:
        self.processes: dict[str, subprocess.Popen[str]] = {}
        self.addresses: dict[str, str] = {}

    async def start(self, count: int) -> None:
        for index in range(count):
            self.processes[f"pod-{index}"] = subprocess.Popen(
                [
                    *POLICYD,
                    "sim",
                    "--pods=1",
                    "--base-port=0",
                    f"--time-scale={TIME_SCALE:g}",
                    f"--seed={index}",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        for name, process in self.processes.items():
            assert process.stdout is not None
            lines = [await asyncio.to_thread(process.stdout.readline) for _ in range(2)]
            self.addresses[name] = lines[1].split("http://")[1].strip()
        async with aiohttp.ClientSession() as client:
            for address in self.addresses.values():  # each publishes its LoRA state
                body = {"model": L4_LLAMA2_7B.base_model, "prompt": "warm up", "max_tokens": 1}
                async with client.post(f"http://{address}/v1/completions", json=body) as answer:
                    answer.raise_for_status()

    def kill(self, name: str) -> None:
        self.processes[name].kill()

    def stop(self) -> None:
        for process in self.processes.values():
            process.kill()
            process.wait()


async def kill_a_pod_under_load(tmp: Path, *, retries: bool) -> Run:
    """One stack (pods, policyd, Envoy); the load; the favourite pod killed at KILL_AT."""
    tmp.mkdir()
    pods = Pods()
    service: Policyd | None = None
    envoy: EnvoyProcess | None = None
    run = Run()
    try:
        await pods.start(PODS)
        policy = tmp / "policy.yaml"
        policy.write_text(POLICY)
        pods_file = tmp / "pods.yaml"
        pods_file.write_text(
            "pods:\n"
            + "".join(f"  - {{name: {n}, address: '{a}'}}\n" for n, a in pods.addresses.items())
        )
        service = Policyd(
            PolicyStore.open(policy),
            Pool(StaticFileDiscovery(pods_file), ScrapeConfig(interval=SCRAPE_INTERVAL)),
            ServerOptions(
                port=0, grace_seconds=1.0, settings=ServingSettings(send_fallbacks=retries)
            ),
        )
        await service.start()
        assert await service.pool.wait_ready(timeout=10)
        pool = service.pool
        await until(lambda: all(p.max_loras for p in pool.snapshot().candidates), "LoRA state")
        options = EnvoyConfigOptions(port=0, admin_port=0, policyd_port=service.port)
        if retries:
            options = dataclasses.replace(options, model_servers=tuple(pods.addresses.values()))
        envoy = await start_envoy(tmp, options)
        url = f"http://127.0.0.1:{envoy.listen_port}"
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
            tasks: list[asyncio.Task[None]] = []
            start = time.monotonic()
            round_before_kill = None

            def sending() -> bool:
                now = time.monotonic()
                if run.killed_at:
                    return now - run.killed_at < DURATION - KILL_AT
                return now - start < DEADLINE

            index = 0
            while sending():
                delay = start + index / RATE - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if round_before_kill is None and time.monotonic() - start >= KILL_AT:
                    round_before_kill = pool.snapshot()
                if (
                    not run.killed_at
                    and round_before_kill is not None
                    and pool.snapshot() is not round_before_kill
                ):
                    run.victim = "pod-0"  # just after a round: a whole interval till the next
                    pods.kill(run.victim)
                    run.killed_at = time.monotonic()
                record = Sent(time.monotonic())
                run.sent.append(record)
                tasks.append(asyncio.create_task(send(client, url, record, f"request {index}")))
                index += 1
            await asyncio.gather(*tasks)
            assert run.killed_at, f"no scrape round came after {KILL_AT} s within {DEADLINE} s"
        run.envoy_stats = await envoy_counters(envoy, "cluster.model_servers.upstream_")
        return run
    finally:
        if envoy is not None:
            envoy.stop()
        if service is not None:
            await service.stop(0)
        pods.stop()


async def test_a_killed_pod_costs_only_the_requests_it_was_serving(tmp_path: Path) -> None:
    without = await kill_a_pod_under_load(tmp_path / "no-retry", retries=False)
    with_retries = await kill_a_pod_under_load(tmp_path / "retry", retries=True)
    report = f"\nno retries: {without.summary()}\nretries:    {with_retries.summary()}"
    print(report)
    # Without retries, requests policyd sent the dead pod before it noticed fail.
    assert without.sent_to_a_dead_pod(), report
    assert "rq_retry" not in without.envoy_stats, report
    # With them, each is retried on the next pod policyd named, and succeeds;
    # only requests the pod was serving when it died are lost.
    assert not with_retries.sent_to_a_dead_pod(), report
    assert with_retries.envoy_stats.get("rq_retry_success", 0) >= 1, report
