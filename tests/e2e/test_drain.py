"""Stopping policyd while a generation streams through Envoy: the stream finishes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from e2e_rig import start_gateway, stop_gateway
from e2e_support import sse_events

from policyd.extproc.grpc_server import ServerOptions

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]


async def test_a_stream_in_flight_finishes_while_policyd_drains(tmp_path: Path) -> None:
    gateway = await start_gateway(tmp_path, server_options=ServerOptions(port=0, grace_seconds=10))
    try:
        upstream = gateway.upstreams["pod-a"]
        upstream.release_stream.clear()
        body = {"model": "m", "prompt": "p", "stream": True}
        async with gateway.client.post(gateway.url + "/v1/completions", json=body) as response:
            expected = sse_events("m")
            first = await asyncio.wait_for(response.content.readexactly(len(expected[0])), 30)
            stopping = asyncio.create_task(gateway.server.stop())
            await asyncio.sleep(0.2)
            assert not stopping.done()
            # A new request cannot reach policyd any more and is refused, not misrouted.
            async with gateway.client.post(
                gateway.url + "/v1/completions", json={"model": "m", "prompt": "p"}
            ) as refused:
                assert refused.status == 503
            upstream.release_stream.set()
            rest = await response.content.read()
        assert first + rest == b"".join(expected)
        await asyncio.wait_for(stopping, 30)
        span = gateway.telemetry.spans[gateway.router.seen[0].id]
        assert span.ended["completed"] is True
        assert (
            span.ended["completion_tokens"]
            == json.loads(expected[-2][6:])["usage"]["completion_tokens"]
        )
        assert len(gateway.router.seen) == 1
    finally:
        await stop_gateway(gateway)
