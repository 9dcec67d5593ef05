"""Flow control through the real Envoy: held at the gateway, dispatched when a pod frees.

Two simulated pods, a policy whose pods are saturated at one request in
flight each (``pod.in_flight >= 1``), so a third request is held by policyd
(its reply to the request-body message waits, Envoy's timeout for it
extended) until a pod frees. Tenants are flows (``x-tenant``); sheddable
requests may wait 500 ms, then get a 429 with ``Retry-After``. The last test
holds a request the same way with Envoy's ext_proc filter shaped as gateways
call an InferencePool's endpoint picker (FULL_DUPLEX_STREAMED bodies).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from e2e_rig import (
    Gateway,
    PolicydGateway,
    start_gateway,
    start_policyd_gateway,
    stop_gateway,
    stop_policyd_gateway,
    until,
)

from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.policy import PolicyStore, Router
from policyd.pool.pod import Pod
from policyd.sim import L4_LLAMA2_7B

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

POLICY = """
name: held
filters:
  all:
    keep: "true"
flow:
  saturated: pod.in_flight >= 1
  bands:
    critical: {max_wait: 60s}
    standard: {max_wait: 60s}
    sheddable: {max_wait: 500ms}
  flows:
    key: request.headers["x-tenant"]
  answer: {status: 429, retry_after: 2s}
"""
SHEDDABLE = {"x-gateway-inference-criticality": "sheddable"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PolicydGateway]:
    policy = tmp_path_factory.mktemp("policy") / "held.yaml"
    policy.write_text(POLICY)
    rig = await start_policyd_gateway(tmp_path_factory.mktemp("flow"), policy, pods=2)
    try:
        yield rig
    finally:
        await stop_policyd_gateway(rig)


def held(gateway: PolicydGateway) -> int:
    return gateway.service.server.processor.holding.control.held


async def post(
    gateway: PolicydGateway, max_tokens: int, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], float, dict[str, str]]:
    """Status, JSON body, the time it finished (monotonic) and the response headers."""
    body = {"model": L4_LLAMA2_7B.base_model, "prompt": "Tell me", "max_tokens": max_tokens}
    async with gateway.client.post(
        gateway.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **(headers or {})},
    ) as response:
        document = await response.json()
        headers = {name.lower(): value for name, value in response.headers.items()}
        return response.status, document, time.monotonic(), headers


async def fill(gateway: PolicydGateway, tenant: str = "big") -> list[asyncio.Task[Any]]:
    """One long request per pod: both pods saturated."""
    tasks = [asyncio.create_task(post(gateway, 300, {"x-tenant": tenant})) for _ in range(2)]
    await until(lambda: gateway.service.pool.snapshot() is not None and busy(gateway) == 2, "busy")
    return tasks


def busy(gateway: PolicydGateway) -> int:
    return sum(p.in_flight for p in gateway.service.pool.snapshot().candidates)


async def test_a_held_request_is_dispatched_when_a_pod_frees(gateway: PolicydGateway) -> None:
    filling = await fill(gateway)
    started = time.monotonic()
    waiting = asyncio.create_task(post(gateway, 4))
    await until(lambda: held(gateway) == 1, "the request to be held")
    status, document, finished, _ = await asyncio.wait_for(waiting, 60)
    assert status == 200 and document["choices"]
    first_done = min(result[2] for result in await asyncio.gather(*filling))
    assert finished > first_done  # served only once a pod had freed
    # Held past Envoy's 1 s message timeout: policyd's override extended it.
    assert finished - started > 1.5
    assert held(gateway) == 0


async def test_a_held_request_whose_client_leaves_leaves_the_queue(
    gateway: PolicydGateway,
) -> None:
    filling = await fill(gateway)
    leaving = asyncio.create_task(post(gateway, 4))
    await until(lambda: held(gateway) == 1, "the request to be held")
    leaving.cancel()  # the client disconnects; Envoy resets the ext_proc stream
    await until(lambda: held(gateway) == 0, "the held request to leave the queue")
    assert busy(gateway) == 2  # while both pods are still busy
    await asyncio.gather(*filling)


async def test_the_max_wait_expires_into_the_configured_answer(gateway: PolicydGateway) -> None:
    filling = await fill(gateway)
    started = time.monotonic()
    status, document, finished, headers = await post(gateway, 4, SHEDDABLE)
    assert status == 429 and document["error"]["code"] == "flow_expired"
    assert headers.get("retry-after") == "2", headers
    assert finished - started >= 0.45  # waited its max wait (the 429 says it expired)
    await asyncio.gather(*filling)


async def test_a_flood_from_one_tenant_does_not_stop_another(gateway: PolicydGateway) -> None:
    filling = await fill(gateway, "flood")
    flood = [asyncio.create_task(post(gateway, 60, {"x-tenant": "flood"})) for _ in range(8)]
    await until(lambda: held(gateway) == 8, "the flood to be held")
    small = asyncio.create_task(post(gateway, 4, {"x-tenant": "small"}))
    await until(lambda: held(gateway) == 9, "the small tenant's request to be held")
    status, _, small_done, _ = await asyncio.wait_for(small, 60)
    assert status == 200
    flood_done = sorted(result[2] for result in await asyncio.gather(*flood))
    assert sum(done > small_done for done in flood_done) >= 5  # most of the flood came later
    await asyncio.gather(*filling)


@dataclass(frozen=True)
class VersionedSnapshot:
    version: int
    candidates: tuple[Pod, ...]


async def test_an_inference_pool_gateway_holds_and_dispatches_too(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    rig: Gateway = await start_gateway(
        tmp_path_factory.mktemp("flow-epp"), EnvoyConfigOptions(ext_proc_mode="inference-pool")
    )
    try:
        policy = tmp_path_factory.mktemp("epp-policy") / "held.yaml"
        policy.write_text(POLICY)
        # The scripted router picks; a real one says what flow control applies.
        rig.router.admission = Router(PolicyStore.open(policy)).admission  # type: ignore[attr-defined]
        rig.pool.snapshot = VersionedSnapshot(0, tuple(rig.pods.values()))  # type: ignore[assignment]
        holding = rig.server.processor.holding
        streams = [
            asyncio.create_task(stream(rig, {"x-test-pick": name})) for name in ("pod-a", "pod-b")
        ]
        await until(lambda: sum(p.in_flight for p in rig.pods.values()) == 2, "both pods busy")
        body = {"model": "m", "prompt": "p"}
        waiting = asyncio.create_task(rig.client.post(rig.url + "/v1/completions", json=body))
        await until(lambda: holding.control.held == 1, "the request to be held")
        await asyncio.sleep(0.3)
        assert not waiting.done()
        for upstream in rig.upstreams.values():
            upstream.release_stream.set()  # the streams end: the pods free up
        async with await asyncio.wait_for(waiting, 30) as response:
            assert response.status == 200
            assert (await response.json())["choices"]
        await asyncio.gather(*streams)
        assert holding.control.held == 0
    finally:
        await stop_gateway(rig)


async def stream(rig: Gateway, headers: dict[str, str]) -> int:
    body = {"model": "m", "prompt": "p", "stream": True}
    async with rig.client.post(rig.url + "/v1/completions", json=body, headers=headers) as reply:
        await reply.read()
        return reply.status
