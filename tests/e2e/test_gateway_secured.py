"""Envoy talking to policyd over mutual TLS, with Envoy tracing on.

With tracing configured, Envoy starts a span per request and sends its own
``traceparent`` as gRPC metadata of the ext_proc stream; policyd must parent
its decision on that one, not on the client's header.

Mutual TLS is required, not merely offered: an Envoy that connects in plain
text, over TLS without a client certificate, or with a certificate another CA
signed, gets no answer from policyd (its health check fails, no decision is
made, the request reaches no pod). And the operator's path works end to end:
``policyd serve --tls-cert --tls-key --tls-client-ca`` behind ``policyd
envoy-config --policyd-tls-ca --policyd-tls-cert --policyd-tls-key``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from e2e_rig import Gateway, policyd_health, start_gateway, stop_gateway, until_serving
from e2e_support import free_port

from policyd.cli import main
from policyd.extproc.envoy_config import EnvoyConfigOptions, PolicydTls
from policyd.extproc.envoy_process import EnvoyProcess, start_envoy
from policyd.extproc.grpc_server import ServerOptions, TlsFiles
from policyd.sim import SimPool

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


# -- mutual TLS is required -------------------------------------------------------------


def rogue_client(directory: Path) -> tuple[Path, Path]:
    """A client certificate and key signed by a CA policyd does not trust."""

    def openssl(*arguments: str) -> None:
        subprocess.run(
            ["openssl", *arguments], cwd=directory, check=True, capture_output=True, timeout=30
        )

    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "rogue-ca.key", "-out", "rogue-ca.crt", "-days", "2", "-subj", "/CN=rogue",
        "-addext", "basicConstraints=critical,CA:TRUE",
    )  # fmt: skip
    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "rogue.key", "-out", "rogue.csr", "-subj", "/CN=rogue",
    )  # fmt: skip
    (directory / "rogue.ext").write_text("extendedKeyUsage=clientAuth\n")
    openssl(
        "x509", "-req", "-in", "rogue.csr", "-CA", "rogue-ca.crt", "-CAkey", "rogue-ca.key",
        "-CAcreateserial", "-days", "2", "-out", "rogue.crt", "-extfile", "rogue.ext",
    )  # fmt: skip
    return directory / "rogue.crt", directory / "rogue.key"


@pytest.mark.parametrize("client_tls", ["plain text", "no client certificate", "rogue CA"])
async def test_an_envoy_without_a_trusted_client_certificate_gets_nothing_from_policyd(
    gateway: Gateway,
    tmp_path: Path,
    certificates: Any,
    client_tls: str,
) -> None:
    tls = {
        "plain text": None,
        "no client certificate": PolicydTls(certificates.ca, server_name="policyd"),
        "rogue CA": PolicydTls(certificates.ca, *rogue_client(tmp_path), "policyd"),
    }[client_tls]
    options = EnvoyConfigOptions(
        port=0, admin_port=0, policyd_port=gateway.server.port, policyd_tls=tls
    )
    intruder = await start_envoy(tmp_path, options)
    try:
        decisions = len(gateway.router.seen)
        received = sum(len(u.received) for u in gateway.upstreams.values())
        url = f"http://127.0.0.1:{intruder.listen_port}/v1/completions"
        async with gateway.client.post(url, json={"model": "m", "prompt": "p"}) as response:
            assert response.status == 503, await response.text()
        deadline = time.monotonic() + 30
        while (health := await policyd_health(gateway.client, intruder.admin_port)) == "healthy":
            assert time.monotonic() < deadline, "the health check never failed"
            await asyncio.sleep(0.1)
        assert "failed_active_hc" in health
        assert len(gateway.router.seen) == decisions  # policyd answered nothing
        assert sum(len(u.received) for u in gateway.upstreams.values()) == received
    finally:
        intruder.stop()
    # The Envoy with the trusted certificate still routes.
    async with gateway.client.post(
        gateway.url + "/v1/completions", json={"model": "m", "prompt": "p"}
    ) as response:
        assert response.status == 200


async def ready_over_mtls(port: int, process: subprocess.Popen[str], certificates: Any) -> None:
    """Until ``policyd serve``'s gRPC health says ``readiness`` is SERVING, asked over mTLS."""
    credentials = grpc.ssl_channel_credentials(
        certificates.ca.read_bytes(),
        certificates.client_key.read_bytes(),
        certificates.client_cert.read_bytes(),
    )
    options = [("grpc.ssl_target_name_override", "policyd")]
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options) as channel:
        await until_serving(channel, process)


async def test_policyd_serve_and_envoy_config_tls_flags_route_end_to_end(
    tmp_path: Path, certificates: Any
) -> None:
    """The operator's commands, as docs/deployment.md gives them: ``policyd serve``
    (its own process) with the server certificate and the CA its clients need,
    behind the Envoy configuration ``policyd envoy-config`` prints for mTLS."""
    sim = SimPool(2, base_port=0, time_scale=20)
    await sim.start()
    pods = tmp_path / "pods.yaml"
    pods.write_text(
        "pods:\n"
        + "".join(f"  - {{name: {s.name}, address: '{s.address}'}}\n" for s in sim.servers)
    )
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "policyd", "serve",
            "--policy", str(Path(__file__).resolve().parents[2] / "rules" / "random.yaml"),
            "--pods", str(pods), "--port", str(port), "--grace-seconds", "1",
            "--tls-cert", str(certificates.server_cert),
            "--tls-key", str(certificates.server_key),
            "--tls-client-ca", str(certificates.ca),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    envoy: EnvoyProcess | None = None
    try:
        await ready_over_mtls(port, process, certificates)
        listen_port, admin_port = free_port(), free_port()
        config = tmp_path / "envoy.yaml"
        assert main([
            "envoy-config", "--port", str(listen_port), "--admin-port", str(admin_port),
            "--policyd-port", str(port),
            "--policyd-tls-ca", str(certificates.ca),
            "--policyd-tls-cert", str(certificates.client_cert),
            "--policyd-tls-key", str(certificates.client_key),
            "--policyd-tls-server-name", "policyd",
            "-o", str(config),
        ]) == 0  # fmt: skip
        envoy = EnvoyProcess(config, admin_port, listen_port=listen_port)
        envoy.start()
        await envoy.wait_ready()
        url = f"http://127.0.0.1:{listen_port}/v1/completions"
        body = {"model": sim.servers[0].profile.base_model, "prompt": "hi", "max_tokens": 2}
        async with aiohttp.ClientSession() as client:
            # Envoy's gRPC health check of policyd's readiness passes over mTLS.
            deadline = time.monotonic() + 30
            while await policyd_health(client, envoy.admin_port) != "healthy":
                assert time.monotonic() < deadline, "the health check never passed"
                await asyncio.sleep(0.1)
            for _ in range(3):
                async with client.post(url, json=body) as response:
                    assert response.status == 200, await response.text()
                    assert (await response.json())["usage"]["completion_tokens"] == 2
    finally:
        if envoy is not None:
            envoy.stop()
        process.kill()
        process.wait()
        await sim.stop()
