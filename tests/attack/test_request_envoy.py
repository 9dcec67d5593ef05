"""The request-path attacks through the real Envoy: what a client of the gateway gets.

Header-only requests declaring the largest body, a body built to cost the most
to parse and a lone surrogate, each sent over HTTP to Envoy in front of
policyd's gRPC server: the attacker gets its 400 as JSON (never a 500), and a
normal request sent meanwhile is routed and answered 200.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_rig import Gateway, start_gateway, stop_gateway, until

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MIB = 1024 * 1024
NORMAL = {"model": "m", "prompt": "hello"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def request_gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Gateway]:
    rig = await start_gateway(tmp_path_factory.mktemp("request-attacks"))
    try:
        yield rig
    finally:
        await stop_gateway(rig)


async def post(gateway: Gateway, body: bytes) -> tuple[int, bytes]:
    async with gateway.client.post(
        gateway.url + "/v1/completions",
        data=body,
        headers={"content-type": "application/json"},
    ) as response:
        return response.status, await response.read()


async def test_header_only_requests_do_not_make_the_gateway_answer_429(
    request_gateway: Gateway,
) -> None:
    """Four clients declare 16 MiB bodies (4 x 16 = the default 64 MiB budget) and
    send none; a normal request is answered 200, not 429."""
    budget = request_gateway.server.processor.body_budget
    port = int(request_gateway.url.rsplit(":", 1)[1])
    stalled = []
    for _ in range(4):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\n"
            b"content-type: application/json\r\ncontent-length: 16777216\r\n\r\n"
        )
        await writer.drain()
        stalled.append((reader, writer))
    try:
        await until(lambda: budget.held >= 32 * MIB, "policyd to see the four requests' headers")
        status, _ = await post(request_gateway, json.dumps(NORMAL).encode())
        assert status == 200
        assert budget.reserved <= budget.limit // 2
    finally:
        for _, writer in stalled:
            writer.close()
    await until(lambda: budget.held == 0, "the stalled requests' reservations to go")


async def test_a_hostile_body_is_a_json_400_and_others_are_served(
    request_gateway: Gateway,
) -> None:
    count = (4 * MIB - 100_000) // 3  # under Envoy's 4 MiB buffer
    hostile = b'{"model": "m", "messages": [' + b",".join([b"{}"] * count) + b"]}"
    answers = await asyncio.gather(
        *(
            request_gateway.client.post(
                request_gateway.url + "/v1/chat/completions",
                data=hostile,
                headers={"content-type": "application/json"},
            )
            for _ in range(3)
        ),
        *(post(request_gateway, json.dumps(NORMAL).encode()) for _ in range(10)),
    )
    for response in answers[:3]:
        assert response.status == 400
        assert response.headers["content-type"] == "application/json"
        assert (await response.json())["error"]["code"] == "body_too_complex"
        response.release()
    assert [status for status, _ in answers[3:]] == [200] * 10


@pytest.mark.parametrize(
    "body",
    [rb'{"model": "m", "prompt": "\ud800"}', rb'{"model": "\udc00x", "prompt": "p"}'],
)
async def test_a_lone_surrogate_is_a_json_400(request_gateway: Gateway, body: bytes) -> None:
    status, answer = await post(request_gateway, body)
    assert status == 400
    assert json.loads(answer)["error"]["code"] == "invalid_json"
    status, _ = await post(request_gateway, json.dumps(NORMAL).encode())
    assert status == 200
