"""How ext_proc streams end, and what a policyd failure does, through the real Envoy.

The generated configuration leaves Envoy's experimental
``ext_proc_graceful_grpc_close`` off (it crashed Envoy 1.40), so Envoy resets
each ext_proc stream as its request ends. policyd ends the stream itself
first, so no read is pending when the reset comes (grpcio leaks a read a reset
cancels: docs/serving.md, "How Envoy ends a stream"), and a reset that still
comes is a normal end, counted and not logged.

ext_proc fails open, so a policyd that stops while generations stream does
not cut them; routing stays fail-closed: a request policyd did not route,
even one that names a destination itself, is answered 503 and reaches no pod.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from e2e_rig import Gateway, settled, start_gateway, stop_gateway, until
from e2e_support import sse_events

from policyd.extproc.replies import DESTINATION_HEADER

pytestmark = [pytest.mark.e2e]

REQUESTS = 60
COMPLETIONS = "/v1/completions"


async def burst(gateway: Gateway) -> None:
    """``REQUESTS`` requests, ten at a time, each answered 200 through Envoy."""

    async def one(stream: bool) -> None:
        async with gateway.client.post(
            gateway.url + COMPLETIONS,
            json={"model": "m", "prompt": "hi", "stream": stream},
            headers={"x-test-pick": "pod-a"},
        ) as response:
            await response.read()
            assert response.status == 200

    gateway.upstreams["pod-a"].release_stream.set()
    for _ in range(REQUESTS // 10):
        await asyncio.gather(*(one(stream=i % 2 == 0) for i in range(10)))
    await settled(gateway.server)
    # The last streams' ends reach policyd after the responses.
    spans = gateway.telemetry.spans
    await until(lambda: all(span.ended for span in spans.values()), "every stream's end")


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    gateway = await start_gateway(tmp_path)
    yield gateway
    await stop_gateway(gateway)


async def test_policyd_ends_each_stream_before_envoy_can_reset_it_and_says_nothing(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="policyd.extproc")
    await burst(gateway)
    assert len(gateway.telemetry.spans) == REQUESTS
    assert all(span.ended["completed"] for span in gateway.telemetry.spans.values())
    # No stream was reset while policyd still waited on it: every one ended by
    # policyd's own status, so no read was left for a reset to cancel.
    assert gateway.telemetry.stream_errors == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_generations_streaming_when_policyd_stops_complete_and_new_requests_get_503(
    gateway: Gateway,
) -> None:
    upstream = gateway.upstreams["pod-b"]
    upstream.release_stream.clear()
    body = {"model": "m", "prompt": "hi", "stream": True}
    expected = b"".join(sse_events("m"))

    streaming = 0

    async def generation() -> bytes:
        nonlocal streaming
        async with gateway.client.post(
            gateway.url + COMPLETIONS, json=body, headers={"x-test-pick": "pod-b"}
        ) as response:
            assert response.status == 200
            first = await response.content.readany()
            streaming += 1
            return first + await response.read()

    streams = [asyncio.create_task(generation()) for _ in range(8)]
    await until_received(upstream, 8)
    await until(lambda: streaming == 8, "the first event of each at its client")
    await gateway.server.stop(0)  # every ext_proc stream goes at once, as in a crash
    await asyncio.sleep(0.5)
    upstream.release_stream.set()
    assert await asyncio.wait_for(asyncio.gather(*streams), timeout=15) == [expected] * 8

    # Routing stays fail-closed: without policyd nothing is routed, and a
    # destination the client names itself is dropped before ext_proc.
    served_before = {name: len(u.received) for name, u in gateway.upstreams.items()}
    for headers in ({}, {DESTINATION_HEADER: gateway.upstreams["pod-a"].address}):
        async with gateway.client.post(
            gateway.url + COMPLETIONS, json={"model": "m", "prompt": "hi"}, headers=headers
        ) as response:
            assert response.status == 503
            # the unrouted route's JSON (its content type is not set: Envoy says text/plain)
            assert json.loads(await response.text())["error"]["code"] == "no_destination"
    assert {name: len(u.received) for name, u in gateway.upstreams.items()} == served_before


async def until_received(upstream: object, count: int, timeout: float = 30.0) -> None:
    received = upstream.received  # type: ignore[attr-defined]
    deadline = asyncio.get_running_loop().time() + timeout
    while len(received) < count:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"only {len(received)} of {count} requests reached the pod")
        await asyncio.sleep(0.01)
