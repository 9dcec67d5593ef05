"""The gateway's edge, through the real Envoy on ``policyd envoy-config``'s bootstrap.

What a hostile client tries at the edge, and what the generated configuration
does about it (docs/serving.md, "Trust model"):

- it names its own priority, deadline or flow (``x-gateway-inference-criticality:
  Critical``, ``x-request-deadline-ms``, ``x-tenant``): by default Envoy removes
  those headers as the request arrives, so neither policyd nor the pod sees
  them; an operator who trusts a proxy in front keeps them
  (``stripped_headers=()``, ``--trust-header``);
- its credentials (``authorization``, ``cookie``, ...) never reach policyd
  (ext_proc ``forward_rules``), and still reach the model server;
- it sends headers and never the body: Envoy's request timeout answers 408 and
  the request reaches no pod; headers never finished get the same answer from
  the request headers timeout.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from e2e_rig import Gateway, start_gateway, stop_gateway

from policyd.extproc.envoy_config import (
    CREDENTIAL_HEADERS,
    PRIORITY_HEADERS,
    EnvoyConfigOptions,
)

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

# Short, so a test waits a second for the timeout it shows (not a bound on anything).
REQUEST_TIMEOUT_S = 1.0
CLAIMS = {
    "x-gateway-inference-criticality": "Critical",
    "x-request-deadline-ms": "1",
    "x-tenant": "fresh-tenant-every-time",
}
CREDENTIALS = {
    "Authorization": "Bearer sk-secret",
    "Proxy-Authorization": "Basic c2VjcmV0",
    "Cookie": "session=secret",
    "X-Api-Key": "sk-other-secret",
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def edge(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Gateway]:
    """The generated defaults, with a short request timeout."""
    options = EnvoyConfigOptions(
        request_timeout_s=REQUEST_TIMEOUT_S, request_headers_timeout_s=REQUEST_TIMEOUT_S
    )
    rig = await start_gateway(tmp_path_factory.mktemp("edge"), options)
    try:
        yield rig
    finally:
        await stop_gateway(rig)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trusting(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Gateway]:
    """The operator's opt-in: a trusted proxy in front sets the priority headers."""
    rig = await start_gateway(
        tmp_path_factory.mktemp("trusting"), EnvoyConfigOptions(stripped_headers=())
    )
    try:
        yield rig
    finally:
        await stop_gateway(rig)


async def complete(gateway: Gateway, headers: dict[str, str]) -> str:
    """POST a completion; the pod that served it (asserting a 200)."""
    async with gateway.client.post(
        gateway.url + "/v1/completions",
        data=json.dumps({"model": "m", "prompt": "hi"}),
        headers={"content-type": "application/json", "x-test-pick": "pod-a", **headers},
    ) as response:
        assert response.status == 200, await response.text()
        return response.headers["x-test-upstream"]


def received_by_pod_a(gateway: Gateway) -> dict[str, str]:
    """The headers of pod-a's last request, by lower-case name."""
    return {k.lower(): v for k, v in gateway.upstreams["pod-a"].received[-1].headers.items()}


async def test_a_clients_priority_deadline_and_flow_headers_reach_neither_policyd_nor_the_pod(
    edge: Gateway,
) -> None:
    assert set(CLAIMS) == set(PRIORITY_HEADERS)
    assert await complete(edge, CLAIMS) == "pod-a"
    seen = edge.router.seen[-1].headers
    received = received_by_pod_a(edge)
    assert [name for name in CLAIMS if name in seen] == []
    assert [name for name in CLAIMS if name in received] == []
    assert seen["x-test-pick"] == "pod-a"  # other headers pass


async def test_with_the_opt_in_the_priority_headers_reach_policyd_and_the_pod(
    trusting: Gateway,
) -> None:
    assert await complete(trusting, CLAIMS) == "pod-a"
    seen = trusting.router.seen[-1].headers
    received = received_by_pod_a(trusting)
    assert {name: seen.get(name) for name in CLAIMS} == CLAIMS
    assert {name: received.get(name) for name in CLAIMS} == CLAIMS


@pytest.mark.parametrize("opted_in", [False, True])
async def test_credentials_never_reach_policyd_and_still_reach_the_pod(
    edge: Gateway, trusting: Gateway, opted_in: bool
) -> None:
    gateway = trusting if opted_in else edge
    assert {name.lower() for name in CREDENTIALS} <= set(CREDENTIAL_HEADERS)
    assert await complete(gateway, CREDENTIALS) == "pod-a"
    seen = gateway.router.seen[-1].headers
    assert [name for name in seen if name in CREDENTIAL_HEADERS] == []
    received = received_by_pod_a(gateway)
    assert {name: received.get(name.lower()) for name in CREDENTIALS} == CREDENTIALS


async def raw_exchange(gateway: Gateway, sent: bytes) -> bytes:
    """Send ``sent`` on a fresh connection and send nothing more: what Envoy answers
    before it closes the connection."""
    host, _, port = gateway.url.removeprefix("http://").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(sent)
        await writer.drain()
        # Envoy's timeout ends this; the wait_for only keeps a broken Envoy from
        # hanging the suite.
        return await asyncio.wait_for(reader.read(), timeout=REQUEST_TIMEOUT_S + 30)
    finally:
        writer.close()


async def test_a_request_whose_body_never_comes_gets_408_and_reaches_no_pod(
    edge: Gateway,
) -> None:
    before = sum(len(u.received) for u in edge.upstreams.values())
    headers_only = (
        b"POST /v1/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n" + b'{"model": "m", '
    )
    answer = await raw_exchange(edge, headers_only)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert sum(len(u.received) for u in edge.upstreams.values()) == before


async def test_headers_that_never_end_get_408(edge: Gateway) -> None:
    answer = await raw_exchange(edge, b"POST /v1/completions HTTP/1.1\r\nhost: edge\r\nx-a: b\r\n")
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
