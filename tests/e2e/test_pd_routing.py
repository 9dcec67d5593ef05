"""Disaggregated prefill/decode through the real Envoy: the decode pod gets the request,
and with it the prefill pod in ``x-prefiller-host-port``, as llm-d's P/D sidecar reads it.

policyd runs its real router over a two-stage policy (a ``prefill`` section)
and a fixed pod set: a decode pod and a prefill pod, each a test upstream that
records the headers it received. What is proved, request by request:

- a long prompt is split: the decode pod receives it, naming the prefill pod's
  ``ip:port``; the prefill pod receives nothing from the gateway (its sidecar
  calls it); both pods count the request in flight until the decode pod
  answers, and the decode pod until the answer ends;
- a short prompt is not split: the decode pod receives it without the header;
- a client's own ``x-prefiller-host-port`` never reaches a pod: the generated
  Envoy removes it as the request arrives, and policyd removes it in every
  routing reply too (a gateway that does not strip it, as an InferencePool's
  endpoint-picker filter does not, in both of its body modes).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from e2e_rig import until
from e2e_support import RecordingTelemetry, SwappablePool, TestUpstream

from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import EnvoyProcess, start_envoy
from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.extproc.replies import PREFILL_HEADER
from policyd.policy import PolicyStore, Router
from policyd.pool.inflight import InFlight
from policyd.pool.pod import Pod
from policyd.prefix.index import ApproximateIndex
from policyd.prefix.probe import PrefixLocator
from policyd.prefix.tokenizers import tokenizer_from_spec

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

POLICY = """\
apiVersion: policyd.dev/v1
kind: RoutingPolicy
name: pd-e2e
params:
  split_at: {type: int, value: 1000}
score:
  light load: {expr: "1.0 - double(pod.in_flight) / 32.0"}
prefill:
  when: double(request.prompt_tokens) * (1.0 - pod.prefix_match) >= double(params.split_at)
"""
ROLES = {"decode-a": "decode", "prefill-a": "prefill"}
LONG = "a shared document " * 400  # 7,200 characters: some 1,800 tokens to policyd's estimate
SHORT = "hello"
FORGED = "6.6.6.6:80"


@dataclass
class PdGateway:
    url: str
    upstreams: dict[str, TestUpstream]
    pods: dict[str, Pod]
    server: ExtProcServer
    envoy: EnvoyProcess
    client: aiohttp.ClientSession


async def start_pd_gateway(
    tmp: Path, envoy: EnvoyConfigOptions, prefix: PrefixLocator | None = None
) -> PdGateway:
    upstreams = {name: TestUpstream(name) for name in ROLES}
    for upstream in upstreams.values():
        await upstream.start()
    pods = {
        name: Pod(name, upstream.address, role=ROLES[name], load=InFlight())
        for name, upstream in upstreams.items()
    }
    (tmp / "pd.yaml").write_text(POLICY)
    router = Router(PolicyStore.open(tmp / "pd.yaml"))
    server = ExtProcServer(
        lambda: router,
        SwappablePool(list(pods.values())).current,
        telemetry=RecordingTelemetry(),
        options=ServerOptions(port=0, grace_seconds=1.0),
        prefix=prefix,
    )
    await server.start()
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    try:
        options = EnvoyConfigOptions(
            port=0,
            admin_port=0,
            policyd_port=server.port,
            ext_proc_mode=envoy.ext_proc_mode,
            prefill_header=envoy.prefill_header,
        )
        process = await start_envoy(tmp, options)
    except BaseException:
        await client.close()
        await server.stop(0)
        for upstream in upstreams.values():
            await upstream.stop()
        raise
    url = f"http://127.0.0.1:{process.listen_port}"
    return PdGateway(url, upstreams, pods, server, process, client)


async def stop_pd_gateway(gateway: PdGateway) -> None:
    try:
        gateway.envoy.stop()
    finally:
        await gateway.client.close()
        await gateway.server.stop(0)
        for upstream in gateway.upstreams.values():
            await upstream.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PdGateway]:
    """Envoy as ``policyd envoy-config`` generates it: the header is removed at the edge."""
    started = await start_pd_gateway(tmp_path_factory.mktemp("pd"), EnvoyConfigOptions())
    try:
        yield started
    finally:
        await stop_pd_gateway(started)


async def complete(
    gateway: PdGateway, prompt: str, headers: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Send one completion; the headers the decode pod received with it."""
    decode = gateway.upstreams["decode-a"]
    before = len(decode.received)
    body = {"model": "m", "prompt": prompt, "max_tokens": 8}
    async with gateway.client.post(
        gateway.url + "/v1/completions", json=body, headers=dict(headers or {})
    ) as response:
        assert response.status == 200, await response.text()
        assert response.headers["x-test-upstream"] == "decode-a"
    assert len(decode.received) == before + 1
    return {key.lower(): value for key, value in decode.received[-1].headers.items()}


async def test_a_long_prompt_names_the_prefill_pod_to_the_decode_pod(gateway: PdGateway) -> None:
    received = await complete(gateway, LONG)
    assert received[PREFILL_HEADER] == gateway.upstreams["prefill-a"].address
    assert gateway.upstreams["prefill-a"].received == []  # the sidecar calls it, not Envoy


async def test_a_short_prompt_is_not_split(gateway: PdGateway) -> None:
    received = await complete(gateway, SHORT)
    assert PREFILL_HEADER not in received


async def test_a_client_cannot_name_a_prefill_pod(gateway: PdGateway) -> None:
    assert PREFILL_HEADER not in await complete(gateway, SHORT, {PREFILL_HEADER: FORGED})
    received = await complete(gateway, LONG, {PREFILL_HEADER: FORGED})
    assert received[PREFILL_HEADER] == gateway.upstreams["prefill-a"].address


async def test_the_prefill_pod_counts_a_split_request_until_the_decode_pod_answers(
    gateway: PdGateway,
) -> None:
    """Both pods count the request while the decode pod's sidecar waits for the
    prefill; its answer's headers mean the prefill is back, and the decode pod alone
    counts it until the answer ends."""
    decode, prefill = gateway.pods["decode-a"], gateway.pods["prefill-a"]
    upstream = gateway.upstreams["decode-a"]
    upstream.release_stream.clear()
    upstream.release_headers.clear()
    before = len(upstream.received)
    body = {"model": "m", "prompt": LONG, "max_tokens": 8, "stream": True}
    sent = asyncio.ensure_future(gateway.client.post(gateway.url + "/v1/completions", json=body))
    try:
        await until(lambda: len(upstream.received) > before, "the decode pod has it")
        assert (decode.in_flight, prefill.in_flight) == (1, 1)
        # Its prompt is queued prefill on the pod that prefills it, not on the decode pod.
        assert decode.queued_prefill_tokens == 0 and prefill.queued_prefill_tokens > 0
        upstream.release_headers.set()
        async with await sent as response:
            assert response.status == 200
            await response.content.readuntil(b"\n\n")  # the first event: the answer is open
            await until(lambda: prefill.in_flight == 0, "the prefill pod released")
            assert decode.in_flight == 1 and prefill.queued_prefill_tokens == 0
            upstream.release_stream.set()
            await response.read()
    finally:
        upstream.release_headers.set()
    await until(lambda: (decode.in_flight, prefill.in_flight) == (0, 0), "both pods released")
    assert upstream.received[-1].headers[PREFILL_HEADER] == prefill.address
    assert json.loads(upstream.received[-1].body)["stream"] is True


@pytest.mark.parametrize("mode", ["buffered", "inference-pool"])
async def test_policyd_removes_a_client_prefill_pod_where_the_gateway_keeps_it(
    tmp_path: Path, mode: str
) -> None:
    """An edge that removes another header (as a gateway that knows nothing of P/D
    removes none): policyd's own replies remove the client's value, and a split
    sets policyd's, in BUFFERED and in FULL_DUPLEX_STREAMED (InferencePool) mode."""
    edge = EnvoyConfigOptions(ext_proc_mode=mode, prefill_header="x-not-this-one")
    started = await start_pd_gateway(tmp_path, edge)
    try:
        assert PREFILL_HEADER not in await complete(started, SHORT, {PREFILL_HEADER: FORGED})
        received = await complete(started, LONG, {PREFILL_HEADER: FORGED})
        assert received[PREFILL_HEADER] == started.upstreams["prefill-a"].address
    finally:
        await stop_pd_gateway(started)


async def test_the_approximate_prefix_index_remembers_the_prompt_on_both_pods(
    tmp_path: Path,
) -> None:
    """The prefill pod computed the prompt and keeps it cached, as the decode pod
    does once the KV cache arrived: the next request sharing it finds it on both."""
    index = ApproximateIndex(1000)
    locator = PrefixLocator(tokenizer_from_spec("estimate"), index, 16)
    started = await start_pd_gateway(tmp_path, EnvoyConfigOptions(), locator)
    try:
        await complete(started, LONG)
        # Not split (some 100 tokens): only its decode pod learns it.
        await complete(started, "another, unrelated question " * 15)
    finally:
        await stop_pd_gateway(started)
    decode, prefill = (started.pods[name].address for name in ("decode-a", "prefill-a"))
    assert index.blocks(prefill) > 0
    assert index.blocks(decode) > index.blocks(prefill)  # the short prompt's blocks too
