"""How Envoy ends ext_proc streams, through the real Envoy.

With ``ext_proc_graceful_grpc_close`` (which ``policyd envoy-config`` sets)
Envoy half-closes each stream and waits for policyd's status; without it,
Envoy resets streams as they end, which leaks memory in grpcio
(docs/serving.md, "How Envoy ends a stream") and which policyd reports.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from e2e_rig import Gateway, settled, start_gateway, stop_gateway

from policyd.extproc.envoy_config import GRACEFUL_CLOSE_FLAG

pytestmark = [pytest.mark.e2e]

REQUESTS = 60


async def burst(gateway: Gateway) -> None:
    """``REQUESTS`` requests, ten at a time, each answered 200 through Envoy."""

    async def one() -> None:
        async with gateway.client.post(
            gateway.url + "/v1/completions",
            json={"model": "m", "prompt": "hi"},
            headers={"x-test-pick": "pod-a"},
        ) as response:
            await response.read()
            assert response.status == 200

    for _ in range(REQUESTS // 10):
        await asyncio.gather(*(one() for _ in range(10)))
    await settled(gateway.server)
    await asyncio.sleep(0.2)  # the last streams' ends reach policyd after the responses


@pytest.fixture
async def graceful(tmp_path: Path) -> AsyncIterator[Gateway]:
    gateway = await start_gateway(tmp_path)
    yield gateway
    await stop_gateway(gateway)


@pytest.fixture
async def resetting(tmp_path: Path) -> AsyncIterator[Gateway]:
    gateway = await start_gateway(tmp_path, runtime={GRACEFUL_CLOSE_FLAG: False})
    yield gateway
    await stop_gateway(gateway)


async def test_with_the_generated_config_envoy_closes_every_stream(graceful: Gateway) -> None:
    await burst(graceful)
    assert len(graceful.telemetry.spans) == REQUESTS
    assert graceful.telemetry.stream_errors == []


async def test_without_the_flag_envoy_resets_finished_streams_and_policyd_says_so(
    resetting: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    await burst(resetting)
    assert len(resetting.telemetry.spans) == REQUESTS
    resets = resetting.telemetry.stream_errors
    assert resets, "no stream was seen reset"
    assert set(resets) == {("reset", "after_end")}
    assert sum("ext_proc_graceful_grpc_close" in r.getMessage() for r in caplog.records) == 1
