"""Envoy's health check of policyd, through the real Envoy: a policyd that starts
after Envoy (as a replica that was not ready yet) is picked up within seconds,
before any request has gone to it, not after Envoy's 60 s no-traffic interval."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
from e2e_rig import policyd_health
from e2e_support import ScriptedRouter, SwappablePool

from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import free_port, start_envoy
from policyd.extproc.grpc_server import ExtProcServer, ServerOptions

pytestmark = [pytest.mark.e2e]


async def test_a_policyd_that_starts_after_envoy_is_healthy_within_seconds(
    tmp_path: Path,
) -> None:
    port = free_port()
    envoy = await start_envoy(tmp_path, EnvoyConfigOptions(port=0, admin_port=0, policyd_port=port))
    server: ExtProcServer | None = None
    try:
        async with aiohttp.ClientSession() as client:
            deadline = time.monotonic() + 30  # generous: fails only what never happens
            while (await policyd_health(client, envoy.admin_port)) == "healthy":
                assert time.monotonic() < deadline, "healthy with nothing listening"
                await asyncio.sleep(0.1)
            router, pool = ScriptedRouter(), SwappablePool([])
            server = ExtProcServer(lambda: router, pool.current, options=ServerOptions(port=port))
            await server.start()
            started = time.monotonic()
            while (await policyd_health(client, envoy.admin_port)) != "healthy":
                assert time.monotonic() - started < 30, "policyd still unhealthy in Envoy"
                await asyncio.sleep(0.1)
    finally:
        envoy.stop()
        if server is not None:
            await server.stop(0)
