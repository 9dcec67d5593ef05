"""The gateway's edge, through the real Envoy on ``policyd envoy-config``'s bootstrap.

What a hostile client tries at the edge, and what the generated configuration
does about it (docs/serving.md, "Trust model"):

- it names its own priority, deadline or flow (``x-gateway-inference-criticality:
  Critical``, ``x-request-deadline-ms``, ``x-tenant``): by default Envoy removes
  those headers as the request arrives, so neither policyd nor the pod sees
  them; an operator who trusts a proxy in front keeps them
  (``stripped_headers=()``, ``--trust-header``), and a filter of the gateway
  that runs after the removal (authentication setting a header from a verified
  claim) still sets them;
- its credentials (``authorization``, ``cookie``, ...) never reach policyd
  (ext_proc ``forward_rules``), and still reach the model server;
- it sends headers and never the body: Envoy's request timeout answers 408 and
  the request reaches no pod; headers never finished get the same answer from
  the request headers timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from e2e_rig import Gateway, start_gateway, stop_gateway

from policyd.extproc.envoy_config import (
    PRIORITY_HEADERS,
    EnvoyConfigOptions,
    bootstrap,
)
from policyd.extproc.envoy_ext_proc import CREDENTIAL_HEADERS
from policyd.extproc.envoy_process import EnvoyProcess, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

# Short, so a test waits a second for the timeout it shows (not a bound on anything).
REQUEST_TIMEOUT_S = 1.0
CLAIMS = {
    "x-gateway-inference-criticality": "Critical",
    "x-llm-d-inference-objective": "premium",
    "x-gateway-inference-objective": "premium",
    "x-llm-d-inference-fairness-id": "fresh-tenant-every-time",
    "x-gateway-inference-fairness-id": "fresh-tenant-every-time",
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


def with_trusted_filter(options: EnvoyConfigOptions, header: str, value: str) -> dict[str, Any]:
    """The bootstrap with a filter before ext_proc that sets ``header`` on every
    request: what an authentication filter does with a verified claim
    (``jwt_authn``'s ``claim_to_headers``, Istio's ``outputClaimToHeaders``)."""
    config = bootstrap(options)
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    trusted = {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3"
            ".HeaderMutation",
            "mutations": {
                "request_mutations": [
                    {
                        "append": {
                            "header": {"key": header, "value": value},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                        }
                    }
                ]
            },
        },
    }
    manager["http_filters"].insert(0, trusted)
    return config


async def test_a_trusted_filter_after_the_removal_still_sets_the_header(
    edge: Gateway, tmp_path: Path
) -> None:
    """The removal runs before every filter: the client's `Sheddable` is gone, and the
    value a filter of the gateway sets reaches policyd and the pod."""
    options = dataclasses.replace(
        EnvoyConfigOptions(),
        port=free_port(),
        admin_port=free_port(),
        policyd_port=edge.server.port,
    )
    config = tmp_path / "trusted.yaml"
    criticality = "x-gateway-inference-criticality"
    config.write_text(yaml.safe_dump(with_trusted_filter(options, criticality, "critical")))
    envoy = EnvoyProcess(
        config, options.admin_port, listen_port=options.port, log_file=tmp_path / "envoy.log"
    )
    envoy.start()
    try:
        await envoy.wait_ready()
        trusted = dataclasses.replace(edge, url=f"http://127.0.0.1:{options.port}")
        assert await complete(trusted, {criticality: "Sheddable"}) == "pod-a"
    finally:
        envoy.stop()
    assert edge.router.seen[-1].headers[criticality] == "critical"
    assert received_by_pod_a(edge)[criticality] == "critical"


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
