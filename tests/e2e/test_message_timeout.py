"""What a client gets when policyd does not answer within Envoy's message timeout.

Envoy gives each ext_proc reply ``message_timeout`` (1 s in the generated
configuration). ext_proc fails open, so a request policyd did not answer in
time goes on without a destination and meets the ``unrouted`` route: a JSON
503, ``no_destination``, the same answer as when policyd is unreachable or
refuses the stream while draining. (With ``failure_mode_allow: false`` Envoy
would answer 504 with an empty body.) policyd is stalled here on purpose: its
router blocks past a shortened timeout.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import pytest_asyncio
from e2e_rig import Gateway, start_gateway, stop_gateway

from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.policy.decision import Decision
from policyd.policy.request import Request
from policyd.pool.pod import Pod

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

TIMEOUT_MS = 1000  # a reply in time makes it even on a loaded machine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Gateway]:
    rig = await start_gateway(
        tmp_path_factory.mktemp("timeout"), EnvoyConfigOptions(message_timeout_ms=TIMEOUT_MS)
    )
    scripted = rig.router.decide

    def decide(request: Request, candidates: Sequence[Pod], prompt: Any = None) -> Decision:
        if "x-test-stall" in request.headers:
            time.sleep(3 * TIMEOUT_MS / 1000)  # holds policyd's event loop: no reply goes out
        return scripted(request, candidates)

    rig.router.decide = decide  # type: ignore[method-assign]
    try:
        yield rig
    finally:
        await stop_gateway(rig)


async def test_a_stalled_policyd_gets_a_503_and_no_pod_sees_the_request(gateway: Gateway) -> None:
    received = sum(len(u.received) for u in gateway.upstreams.values())
    started = time.monotonic()
    async with gateway.client.post(
        gateway.url + "/v1/completions",
        json={"model": "m", "prompt": "p"},
        headers={"x-test-stall": "1"},
    ) as response:
        status, body, headers = response.status, await response.text(), response.headers
    assert time.monotonic() - started >= TIMEOUT_MS / 1000
    assert status == 503, body
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "no_destination"
    assert sum(len(u.received) for u in gateway.upstreams.values()) == received


async def test_a_reply_in_time_routes_as_usual(gateway: Gateway) -> None:
    async with gateway.client.post(
        gateway.url + "/v1/completions",
        json={"model": "m", "prompt": "p"},
        headers={"x-test-pick": "pod-b"},
    ) as response:
        assert response.status == 200
        assert response.headers["x-test-upstream"] == "pod-b"
