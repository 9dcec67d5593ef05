"""The end-to-end rigs: policyd in process behind the real Envoy.

- ``start_gateway``: test upstreams and a scripted router, to prove the wire
  path case by case;
- ``start_policyd_gateway``: the ``Policyd`` service ``policyd serve`` runs
  (real PolicyStore with hot reload, Router, Pool scraping) over simulated
  vLLM pods, to prove the whole product.

Everything binds loopback ports chosen at run time, and ``stop_gateway`` stops
Envoy even when a test failed; Envoy is also started with a parent-death
signal, so not even a killed pytest leaves one behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
from e2e_support import RecordingTelemetry, ScriptedRouter, SwappablePool, TestUpstream
from grpc_health.v1 import health_pb2, health_pb2_grpc

from policyd.demo.stack import warm_up
from policyd.extproc.assembly import Policyd
from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import EnvoyProcess, start_envoy
from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.extproc.prefix_matching import KV_EVENTS_PORT_LABEL, KV_REPLAY_PORT_LABEL
from policyd.policy import PolicyStore, Reload
from policyd.pool import Pool, ScrapeConfig, StaticFileDiscovery
from policyd.pool.pod import Pod
from policyd.prefix.options import PrefixSettings
from policyd.sim import SimPool, SimServer


@dataclass
class Gateway:
    url: str
    upstreams: dict[str, TestUpstream]
    pods: dict[str, Pod]
    router: ScriptedRouter
    pool: SwappablePool
    telemetry: RecordingTelemetry
    server: ExtProcServer
    envoy: EnvoyProcess
    client: aiohttp.ClientSession


async def start_gateway(
    tmp: Path,
    envoy_options: EnvoyConfigOptions | None = None,
    server_options: ServerOptions | None = None,
    upstream_names: tuple[str, ...] = ("pod-a", "pod-b"),
    runtime: dict[str, bool] | None = None,
) -> Gateway:
    """Start upstreams, policyd and Envoy; ``envoy_options`` ports are chosen here.

    ``runtime`` overrides runtime flags the generated bootstrap sets. Without
    ``envoy_options`` Envoy keeps the client's priority headers
    (``stripped_headers=()``): the tests' clients stand for a trusted proxy.
    """
    upstreams = {name: TestUpstream(name) for name in upstream_names}
    for upstream in upstreams.values():
        await upstream.start()
    pods = {name: Pod(name, upstream.address) for name, upstream in upstreams.items()}
    router = ScriptedRouter()
    pool = SwappablePool(list(pods.values()))
    telemetry = RecordingTelemetry()
    server = ExtProcServer(
        lambda: router,
        pool.current,
        telemetry=telemetry,
        options=server_options or ServerOptions(port=0, grace_seconds=1.0),
    )
    await server.start()
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    try:
        options = dataclasses.replace(
            envoy_options or EnvoyConfigOptions(stripped_headers=()),
            port=0,
            admin_port=0,
            policyd_port=server.port,
        )
        envoy = await start_envoy(tmp, options, runtime=runtime)
    except BaseException:
        await client.close()
        await server.stop(0)
        for upstream in upstreams.values():
            await upstream.stop()
        raise
    return Gateway(
        f"http://127.0.0.1:{envoy.listen_port}",
        upstreams,
        pods,
        router,
        pool,
        telemetry,
        server,
        envoy,
        client,
    )


async def stop_gateway(gateway: Gateway) -> None:
    try:
        gateway.envoy.stop()
    finally:
        await gateway.client.close()
        await gateway.server.stop(0)
        for upstream in gateway.upstreams.values():
            await upstream.stop()


# -- the real thing: simulated vLLM pods + policyd's own store, router and pool ------------


@dataclass
class PolicydGateway:
    """Envoy in front of a ``Policyd`` service (real PolicyStore, Router and Pool)
    routing over simulated vLLM pods listed in a static pod file."""

    url: str
    sim: SimPool
    service: Policyd
    telemetry: RecordingTelemetry
    reloads: list[Reload]
    policy_path: Path
    envoy: EnvoyProcess
    client: aiohttp.ClientSession

    def server(self, pod: str) -> SimServer:
        return next(server for server in self.sim.servers if server.name == pod)

    def served(self) -> dict[str, int]:
        """Requests each simulated pod has finished (counted by the pod itself)."""
        return {
            server.name: sum(server.driver.engine.stats.finished.values()) if server.running else 0
            for server in self.sim.servers
        }


def _labels(server: SimServer) -> str:
    """The pod's labels in the pods file: its role, and its KV-event ports when it has them."""
    labels = ["role: serving"]
    for label, port in (
        (KV_EVENTS_PORT_LABEL, server.kv_events_port),
        (KV_REPLAY_PORT_LABEL, server.kv_replay_port),
    ):
        if port is not None:
            labels.append(f"'{label}': '{port}'")
    return ", ".join(labels)


async def start_policyd_gateway(
    tmp: Path,
    policy: Path,
    *,
    pods: int = 6,
    time_scale: float = 4.0,
    extra_pods: str = "",
    scrape_interval: float = 0.05,
    policy_poll_seconds: float = 0.1,
    prefix: PrefixSettings | None = None,
) -> PolicydGateway:
    """Start the pods, policyd over ``policy`` (a file or directory) and Envoy.

    The pod file lists the simulated pods (label ``role: serving``) and then
    ``extra_pods``, YAML list items for pods outside the simulation. Envoy keeps
    the client's priority headers: the tests' clients stand for a trusted
    proxy that sets them. In
    precise prefix mode the pods publish KV events, each on its own ports,
    which their labels name.
    """
    precise = prefix is not None and prefix.mode == "precise"
    sim = SimPool(
        pods, base_port=0, time_scale=time_scale, kv_events_port_base=0 if precise else None
    )
    await sim.start()
    telemetry = RecordingTelemetry()
    reloads: list[Reload] = []
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    service: Policyd | None = None
    try:
        await warm_up(sim.servers)
        pods_file = tmp / "pods.yaml"
        pods_file.write_text(
            "pods:\n"
            + "".join(
                f"  - {{name: {s.name}, address: '{s.address}', labels: {{{_labels(s)}}}}}\n"
                for s in sim.servers
            )
            + extra_pods
        )
        service = Policyd(
            PolicyStore.open(policy),
            Pool(StaticFileDiscovery(pods_file), ScrapeConfig(interval=scrape_interval)),
            ServerOptions(port=0, grace_seconds=5.0),
            telemetry=telemetry,
            policy_poll_seconds=policy_poll_seconds,
            on_reload=reloads.append,
            prefix=prefix,
        )
        await service.start()
        assert await service.pool.wait_ready(timeout=10)
        await until(lambda: all(p.max_loras for p in service_candidates(service)), "LoRA state")
        envoy = await start_envoy(
            tmp,
            EnvoyConfigOptions(
                port=0, admin_port=0, policyd_port=service.port, stripped_headers=()
            ),
        )
    except BaseException:
        await client.close()
        if service is not None:
            await service.stop(0)
        await sim.stop()
        raise
    return PolicydGateway(
        f"http://127.0.0.1:{envoy.listen_port}",
        sim,
        service,
        telemetry,
        reloads,
        policy,
        envoy,
        client,
    )


async def stop_policyd_gateway(gateway: PolicydGateway) -> None:
    try:
        gateway.envoy.stop()
    finally:
        await gateway.client.close()
        await gateway.service.stop(0)
        await gateway.sim.stop()


async def until_serving(
    channel: grpc.aio.Channel, process: subprocess.Popen[str], timeout: float = 30
) -> None:
    """Until ``policyd serve``'s gRPC health, asked over ``channel``, says ``readiness``
    is SERVING; fails if the process exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    stub = health_pb2_grpc.HealthStub(channel)
    while time.monotonic() < deadline:
        assert process.poll() is None, "policyd serve exited during start"
        try:
            request = health_pb2.HealthCheckRequest(service="readiness")
            answer = await stub.Check(request, timeout=1)
            if answer.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("policyd serve did not become ready")


async def policyd_health(client: aiohttp.ClientSession, admin_port: int) -> str:
    """The health flags Envoy's admin page shows for its policyd host (``healthy``, or
    what failed, e.g. ``/failed_active_hc``)."""
    async with client.get(f"http://127.0.0.1:{admin_port}/clusters") as response:
        text = await response.text()
    (flags,) = [
        line.rpartition("::")[2]
        for line in text.splitlines()
        if line.startswith("policyd::") and "::health_flags::" in line
    ]
    return flags


def service_candidates(service: Policyd) -> tuple[Pod, ...]:
    return service.pool.snapshot().candidates


async def settled(server: ExtProcServer) -> None:
    """Wait for policyd's bookkeeping of the requests that finished (spans, usage):
    it is settled a few milliseconds after their replies (``settlement.py``)."""
    await until(lambda: server.processor.settlement.idle, "policyd to settle its bookkeeping")


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` every 10 ms; fail the test with ``what`` after ``timeout`` (generous:
    it fails only what never happens, however loaded the machine)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)
