"""llm-d's inference-sim as model-server pods, and ``policyd serve`` with Envoy in front.

The inference-sim (``../shared/tools/real-tools.sh inference-sim``) is a vLLM
simulator written independently of policyd: its metrics, LoRA state, KV events
and errors are what llm-d's own router is tested against. Each pod is one
process on a loopback port, with ``POD_IP=127.0.0.1`` (the simulator names
itself by it in its KV-event topic and refuses to start its KV cache without
it) and its dummy tokenizer (a model name that is no Hugging Face model, and no
network to ask).

Its KV-event publisher connects to ``--zmq-endpoint`` instead of binding it,
while policyd subscribes to each pod's port: ``KvRelay`` is the ZMQ forwarder
an operator places between them (docs/model-servers.md), a SUB socket bound
where the pod connects and a PUB socket bound where policyd does, passing every
message on unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import aiohttp
import grpc
import zmq
import zmq.asyncio
from e2e_rig import until_serving
from prometheus_client.parser import text_string_to_metric_families

from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import EnvoyProcess, free_port, start_envoy
from policyd.extproc.prefix_matching import KV_EVENTS_PORT_LABEL, KV_REPLAY_PORT_LABEL

REPO = Path(__file__).resolve().parents[2]
MODEL = "infsim/base"  # no Hugging Face model: the simulator's dummy tokenizer
READY_S = 60.0  # however loaded the machine: fails only what never happens


@dataclass
class KvRelay:
    """A ZMQ forwarder: the pod's PUB connects to ``inbound``, policyd's SUB to ``outbound``."""

    inbound: zmq.asyncio.Socket
    outbound: zmq.asyncio.Socket
    inbound_port: int
    outbound_port: int
    task: asyncio.Task[None] | None = None

    @classmethod
    def open(cls) -> KvRelay:
        context = zmq.asyncio.Context.instance()
        inbound = context.socket(zmq.SUB)
        inbound.setsockopt(zmq.SUBSCRIBE, b"")
        outbound = context.socket(zmq.PUB)
        relay = cls(
            inbound,
            outbound,
            inbound.bind_to_random_port("tcp://127.0.0.1"),
            outbound.bind_to_random_port("tcp://127.0.0.1"),
        )
        relay.task = asyncio.create_task(relay._forward())
        return relay

    async def _forward(self) -> None:
        while True:
            await self.outbound.send_multipart(await self.inbound.recv_multipart())

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.inbound.close(linger=0)
        self.outbound.close(linger=0)


@dataclass
class SimPod:
    """One inference-sim process."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    relay: KvRelay | None = None
    replay_port: int | None = None
    role: str | None = None  # the llm-d.ai/role label policyd reads (None: none)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def pods_file_entry(self) -> str:
        labels = "role: serving"
        if self.role is not None:
            labels += f", 'llm-d.ai/role': {self.role}"
        if self.relay is not None:
            labels += f", '{KV_EVENTS_PORT_LABEL}': '{self.relay.outbound_port}'"
        if self.replay_port is not None:
            labels += f", '{KV_REPLAY_PORT_LABEL}': '{self.replay_port}'"
        return f"  - {{name: {self.name}, address: '{self.address}', labels: {{{labels}}}}}\n"


def start_pod(
    binary: str, name: str, tmp: Path, *flags: str, kv_events: bool = False, replay: bool = False
) -> SimPod:
    """Start one pod (``flags`` after the model and port); with ``kv_events``, its KV cache
    on and its events forwarded by a ``KvRelay`` (call it inside the event loop), and with
    ``replay`` its replay socket too (which it binds itself)."""
    port = free_port()
    relay = KvRelay.open() if kv_events else None
    replay_port = free_port() if kv_events and replay else None
    command = [binary, "--model", MODEL, "--port", str(port), "--force-dummy-tokenizer", *flags]
    if relay is not None:
        command += ["--enable-kvcache", "--zmq-endpoint", f"tcp://127.0.0.1:{relay.inbound_port}"]
    if replay_port is not None:
        command += ["--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}"]
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "POD_IP": "127.0.0.1"}
        )
    return SimPod(name, port, process, log, relay, replay_port)


async def until_ready(client: aiohttp.ClientSession, pods: Sequence[SimPod]) -> None:
    """Until every pod answers ``/health`` and publishes its metrics."""
    deadline = time.monotonic() + READY_S
    for pod in pods:
        while True:
            assert pod.process.poll() is None, f"{pod.name} exited: {pod.log.read_text()[-2000:]}"
            with contextlib.suppress(aiohttp.ClientError):
                async with client.get(pod.url + "/health") as response:
                    if response.status == 200:
                        break
            assert time.monotonic() < deadline, f"{pod.name} did not become ready"
            await asyncio.sleep(0.1)


async def stop_pods(pods: Sequence[SimPod]) -> None:
    for pod in pods:
        if pod.process.poll() is None:
            pod.process.terminate()
    for pod in pods:
        try:
            await asyncio.to_thread(pod.process.wait, 10)
        except subprocess.TimeoutExpired:
            pod.process.kill()
            pod.process.wait()
        if pod.relay is not None:
            await pod.relay.close()


async def pod_metrics(client: aiohttp.ClientSession, url: str) -> dict[str, list[Any]]:
    """A /metrics page's samples by sample name."""
    async with client.get(url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


@dataclass
class Gateway:
    """Envoy in front of one ``policyd serve`` process."""

    envoy: EnvoyProcess
    process: subprocess.Popen[str]
    monitoring_port: int
    decision_log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listen_port}"

    @property
    def monitoring_url(self) -> str:
        return f"http://127.0.0.1:{self.monitoring_port}"

    def decisions(self) -> list[dict[str, Any]]:
        """Every decision logged so far (a JSON line each), oldest first."""
        if not self.decision_log.exists():
            return []
        return [json.loads(line) for line in self.decision_log.read_text().splitlines()]


class PodEntry(Protocol):
    """A pod as the pods file lists it (a ``SimPod``, or a sidecar in front of one)."""

    def pods_file_entry(self) -> str: ...


# Envoy batches spans for 5 s by default; a test that reads a trace wants them at once.
SPANS_AT_ONCE: Final = {
    "tracing.opentelemetry.flush_interval_ms": 100,
    "tracing.opentelemetry.min_flush_spans": 1,
}


@asynccontextmanager
async def gateway(
    tmp: Path,
    policy: Path,
    pods: Sequence[PodEntry],
    *flags: str,
    otlp_endpoint: str | None = None,
) -> AsyncIterator[Gateway]:
    """``policyd serve`` over ``policy`` and the pods (``flags`` added), Envoy in front;
    with ``otlp_endpoint``, both export their spans there."""
    pods_file = tmp / "pods.yaml"
    pods_file.write_text("pods:\n" + "".join(pod.pods_file_entry() for pod in pods))
    port, monitoring = free_port(), free_port()
    decision_log = tmp / "decisions.jsonl"
    command = [
        sys.executable, "-m", "policyd", "serve", "--policy", str(policy),
        "--pods", str(pods_file), "--port", str(port), "--monitoring-port", str(monitoring),
        "--decision-log", str(decision_log), "--grace-seconds", "1",
        # Every pod stays a candidate while a loaded machine misses a scrape: these tests
        # are about what the pods say, not about staleness.
        "--scrape-interval", "0.1", "--stale-after", "30", "--log-level", "warning", *flags,
    ]  # fmt: skip
    if otlp_endpoint is not None:
        command += ["--otlp-endpoint", otlp_endpoint]
    with (tmp / "policyd.log").open("w") as errors:
        process = subprocess.Popen(command, stderr=errors, text=True)
    envoy: EnvoyProcess | None = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await until_serving(channel, process, READY_S)
        options = EnvoyConfigOptions(
            port=0,
            admin_port=0,
            policyd_port=port,
            stripped_headers=(),
            otlp_endpoint=otlp_endpoint,
        )
        runtime = SPANS_AT_ONCE if otlp_endpoint is not None else None
        envoy = await start_envoy(tmp, options, runtime=runtime)
        yield Gateway(envoy, process, monitoring, decision_log)
    finally:
        if envoy is not None:
            envoy.stop()
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, 10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
