"""The end-to-end rig: test upstreams + policyd (in process) + the real Envoy.

Everything binds loopback ports chosen at run time, and ``stop_gateway`` stops
Envoy even when a test failed; Envoy is also started with a parent-death
signal, so not even a killed pytest leaves one behind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from e2e_support import RecordingTelemetry, ScriptedRouter, SwappablePool, TestUpstream, free_port

from policyd.extproc.envoy_config import EnvoyConfigOptions, render
from policyd.extproc.envoy_process import EnvoyProcess
from policyd.extproc.server import ExtProcServer, ServerOptions
from policyd.pool.pod import Pod


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
) -> Gateway:
    """Start upstreams, policyd and Envoy; ``envoy_options`` ports are filled in here."""
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
    listen_port, admin_port = free_port(), free_port()
    options = dataclasses.replace(
        envoy_options or EnvoyConfigOptions(),
        port=listen_port,
        admin_port=admin_port,
        policyd_port=server.port,
    )
    config = tmp / "envoy.yaml"
    config.write_text(render(options))
    envoy = EnvoyProcess(config, admin_port, log_file=tmp / "envoy.log")
    envoy.start()
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    gateway = Gateway(
        f"http://127.0.0.1:{listen_port}",
        upstreams,
        pods,
        router,
        pool,
        telemetry,
        server,
        envoy,
        client,
    )
    try:
        await envoy.wait_ready()
    except BaseException:
        await stop_gateway(gateway)
        raise
    return gateway


async def stop_gateway(gateway: Gateway) -> None:
    try:
        gateway.envoy.stop()
    finally:
        await gateway.client.close()
        await gateway.server.stop(0)
        for upstream in gateway.upstreams.values():
            await upstream.stop()
