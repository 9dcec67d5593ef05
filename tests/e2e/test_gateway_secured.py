"""Envoy talking to policyd over mutual TLS, with Envoy tracing on.

With tracing configured, Envoy starts a span per request and sends its own
``traceparent`` as gRPC metadata of the ext_proc stream; policyd must parent
its decision on that one, not on the client's header.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from e2e_rig import Gateway, start_gateway, stop_gateway
from e2e_support import free_port

from policyd.extproc.envoy_config import EnvoyConfigOptions, PolicydTls
from policyd.extproc.server import ServerOptions, TlsFiles

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = f"00-{CLIENT_TRACE_ID}-b7ad6b7169203331-01"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(
    tmp_path_factory: pytest.TempPathFactory, certificates: Any
) -> AsyncIterator[Gateway]:
    envoy_options = EnvoyConfigOptions(
        policyd_tls=PolicydTls(
            certificates.ca, certificates.client_cert, certificates.client_key, "policyd"
        ),
        otlp_endpoint=f"127.0.0.1:{free_port()}",  # nobody listens: spans are dropped
    )
    server_options = ServerOptions(
        port=0,
        grace_seconds=1.0,
        tls=TlsFiles(certificates.server_cert, certificates.server_key, certificates.ca),
    )
    rig = await start_gateway(tmp_path_factory.mktemp("secured"), envoy_options, server_options)
    try:
        yield rig
    finally:
        await stop_gateway(rig)


async def test_requests_are_routed_over_mutual_tls(gateway: Gateway) -> None:
    async with gateway.client.post(
        gateway.url + "/v1/completions",
        json={"model": "m", "prompt": "p"},
        headers={"x-test-pick": "pod-b"},
    ) as response:
        assert response.status == 200
        assert response.headers["x-test-upstream"] == "pod-b"


async def test_the_decision_is_parented_on_envoys_span_not_the_clients(gateway: Gateway) -> None:
    async with gateway.client.post(
        gateway.url + "/v1/completions",
        json={"model": "m", "prompt": "p"},
        headers={"traceparent": CLIENT_PARENT},
    ) as response:
        assert response.status == 200
    span = gateway.telemetry.spans[gateway.router.seen[-1].id]
    version, trace_id, parent_id, _ = span.carrier["traceparent"].split("-")
    assert (version, trace_id) == ("00", CLIENT_TRACE_ID)  # the same trace ...
    assert parent_id != CLIENT_PARENT.split("-")[2]  # ... under Envoy's own span
    assert "tracestate" not in span.carrier  # Envoy sends it empty; empty is dropped
    # The model server's request carries the same trace.
    received = gateway.upstreams["pod-a"].received[-1]
    assert received.headers["traceparent"].split("-")[1] == CLIENT_TRACE_ID
