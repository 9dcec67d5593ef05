"""P/D over real HTTP: the ``kv_transfer_params`` exchange llm-d's P/D sidecar drives
(NixlConnector's fields), and a decode pod doing the sidecar's part in-process.

The requests are shaped as the sidecar (pkg/sidecar/proxy, NIXL v2) shapes them:
to the prefill pod the client's body with ``max_tokens`` 1, not streamed, and
``kv_transfer_params`` asking ``do_remote_decode`` with null remote fields; to
the decode pod the client's body with the prefill pod's ``kv_transfer_params``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from policyd.extproc.envoy_process import free_port
from policyd.sim.pool import SimPool
from policyd.sim.profile import H100_LLAMA31_8B
from policyd.sim.server import PREFILLER_HEADER, SimServer

TIME_SCALE = 20.0
BASE = H100_LLAMA31_8B.base_model
PROMPT = " ".join(f"doc{i}" for i in range(600))  # 601 tokens with the BOS
PROMPT_TOKENS = 601
NULL_REMOTE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.fixture
async def pods() -> AsyncIterator[tuple[SimServer, SimServer]]:
    prefill = SimServer(H100_LLAMA31_8B, name="prefill-0", time_scale=TIME_SCALE, role="prefill")
    decode = SimServer(
        H100_LLAMA31_8B, name="decode-0", time_scale=TIME_SCALE, role="decode", pd_in_process=True
    )
    await prefill.start()
    await decode.start()
    try:
        yield prefill, decode
    finally:
        await decode.stop()
        await prefill.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def post(
    client: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str] | None = None,
    status: int = 200,
) -> dict[str, Any]:
    async with client.post(url + "/v1/completions", json=payload, headers=headers) as response:
        assert response.status == status, await response.text()
        body: dict[str, Any] = await response.json()
        return body


async def metrics(client: aiohttp.ClientSession, server: SimServer) -> dict[str, float]:
    async with client.get(server.url + "/metrics") as response:
        text = await response.text()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels.get("le")
        and sample.name.startswith("vllm:")
        and "finished_reason" not in sample.labels
    }


async def test_the_sidecar_exchange_prefills_on_one_pod_and_decodes_on_the_other(
    pods: tuple[SimServer, SimServer], client: aiohttp.ClientSession
) -> None:
    prefill, decode = pods
    asked = {"model": BASE, "prompt": PROMPT, "max_tokens": 1, "stream": False}
    first = await post(client, prefill.url, {**asked, "kv_transfer_params": NULL_REMOTE})
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == prefill.engine_id
    assert (params["remote_host"], params["remote_port"]) == (prefill.host, prefill.port)
    assert len(params["remote_block_ids"]) == math.ceil(PROMPT_TOKENS / 16)
    assert first["usage"]["completion_tokens"] == 1
    second = await post(
        client,
        decode.url,
        {
            "model": BASE,
            "prompt": PROMPT,
            "max_tokens": 9,
            "sim_output_tokens": 9,
            "kv_transfer_params": params,
        },
    )
    assert second["usage"]["completion_tokens"] == 9
    assert second["kv_transfer_params"] is None  # as vLLM answers a decode
    on_prefill, on_decode = await metrics(client, prefill), await metrics(client, decode)
    assert on_prefill["vllm:generation_tokens_total"] == 1
    assert on_decode["vllm:generation_tokens_total"] == 9
    assert on_prefill["vllm:prompt_tokens_total"] == on_decode["vllm:prompt_tokens_total"] == 601
    # The decode pod read the whole prompt's KV: vLLM's NIXL histograms count it there.
    assert on_decode["vllm:nixl_bytes_transferred_count"] == 1
    assert on_decode["vllm:nixl_bytes_transferred_sum"] == PROMPT_TOKENS * 131072
    assert on_decode["vllm:nixl_xfer_time_seconds_sum"] == pytest.approx(
        PROMPT_TOKENS * 131072 / H100_LLAMA31_8B.kv_transfer_bytes_per_s
    )
    assert "vllm:nixl_bytes_transferred_count" not in on_prefill


async def test_a_plain_request_answers_without_kv_transfer_params(
    pods: tuple[SimServer, SimServer], client: aiohttp.ClientSession
) -> None:
    answer = await post(client, pods[0].url, {"model": BASE, "prompt": "hi", "max_tokens": 2})
    assert "kv_transfer_params" not in answer


@pytest.mark.parametrize(
    "params",
    [
        "yes",
        {"do_remote_decode": True, "do_remote_prefill": True},
        {"do_remote_prefill": True, "remote_block_ids": [1]},  # no engine id
        {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": ["a"]},
        {"do_remote_decode": "true"},
    ],
)
async def test_malformed_kv_transfer_params_are_a_400(
    pods: tuple[SimServer, SimServer], client: aiohttp.ClientSession, params: object
) -> None:
    answer = await post(
        client,
        pods[1].url,
        {"model": BASE, "prompt": "hi", "kv_transfer_params": params},
        status=400,
    )
    assert "kv_transfer_params" in answer["error"]["message"]


async def test_in_process_the_decode_pod_has_the_named_pod_prefill(
    pods: tuple[SimServer, SimServer], client: aiohttp.ClientSession
) -> None:
    prefill, decode = pods
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 5, "sim_output_tokens": 5}
    answer = await post(client, decode.url, body, {PREFILLER_HEADER: prefill.address})
    assert answer["usage"]["completion_tokens"] == 5
    assert answer["kv_transfer_params"] is None  # the decode's answer, as behind the sidecar
    on_prefill, on_decode = await metrics(client, prefill), await metrics(client, decode)
    assert on_prefill["vllm:generation_tokens_total"] == 1
    assert on_prefill["vllm:prompt_tokens_total"] == PROMPT_TOKENS
    assert on_decode["vllm:generation_tokens_total"] == 5


async def test_in_process_a_stream_is_decoded_after_the_remote_prefill(
    pods: tuple[SimServer, SimServer], client: aiohttp.ClientSession
) -> None:
    prefill, decode = pods
    body = {
        "model": BASE,
        "prompt": PROMPT,
        "max_tokens": 3,
        "sim_output_tokens": 3,
        "stream": True,
    }
    async with client.post(
        decode.url + "/v1/completions", json=body, headers={PREFILLER_HEADER: prefill.address}
    ) as response:
        assert response.status == 200
        events = (await response.read()).split(b"\n\n")
    assert events[-2] == b"data: [DONE]" and len(events) == 5
    assert (await metrics(client, prefill))["vllm:generation_tokens_total"] == 1


async def test_in_process_an_unreachable_prefill_pod_is_a_clear_502(
    pods: tuple[SimServer, SimServer], client: aiohttp.ClientSession
) -> None:
    prefill, decode = pods
    await prefill.stop()
    answer = await post(
        client,
        decode.url,
        {"model": BASE, "prompt": PROMPT},
        {PREFILLER_HEADER: prefill.address},
        status=502,
    )
    message = answer["error"]["message"]
    assert "cannot reach the prefill pod" in message and prefill.address in message


async def test_in_process_a_prefill_error_reaches_the_client_as_the_sidecar_forwards_it(
    pods: tuple[SimServer, SimServer], client: aiohttp.ClientSession
) -> None:
    prefill, decode = pods
    prefill.set_faults(fail_status=503)
    answer = await post(
        client,
        decode.url,
        {"model": BASE, "prompt": PROMPT},
        {PREFILLER_HEADER: prefill.address},
        status=503,
    )
    assert answer["error"]["message"] == "simulated failure injected on this pod"
    assert (await metrics(client, decode))["vllm:generation_tokens_total"] == 0


async def test_a_pod_without_in_process_p_d_ignores_the_header(
    client: aiohttp.ClientSession,
) -> None:
    pod = SimServer(H100_LLAMA31_8B, time_scale=TIME_SCALE)
    await pod.start()
    try:
        answer = await post(
            client,
            pod.url,
            {"model": BASE, "prompt": PROMPT, "max_tokens": 2},
            {PREFILLER_HEADER: "127.0.0.1:9"},
        )
    finally:
        await pod.stop()
    assert answer["usage"]["completion_tokens"] >= 1


def test_the_pool_writes_each_pods_role_label() -> None:
    pool = SimPool(3, base_port=0, profile=H100_LLAMA31_8B, roles=["prefill", "decode", "both"])
    pods = yaml.safe_load(pool.pods_yaml())["pods"]
    assert [p["labels"]["llm-d.ai/role"] for p in pods] == ["prefill", "decode", "both"]
    with pytest.raises(ValueError, match="one role per pod"):
        SimPool(2, base_port=0, roles=["prefill"])
    with pytest.raises(ValueError, match="unknown pod role"):
        SimPool(1, base_port=0, roles=["encoder"])


async def test_in_process_the_prefill_joins_the_callers_trace(
    pods: tuple[SimServer, SimServer], client: aiohttp.ClientSession
) -> None:
    """The decode pod passes the request's W3C trace context to the prefill pod, as the
    sidecar's instrumented client does (a recording proxy, written here, sees it)."""
    prefill, decode = pods
    seen: list[dict[str, str]] = []

    async def forward(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        async with client.post(prefill.url + request.path, data=await request.read()) as answer:
            return web.Response(
                status=answer.status, body=await answer.read(), content_type="application/json"
            )

    app = web.Application()
    app.router.add_post("/v1/completions", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        trace = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01", "tracestate": "vendor=1"}
        body = {"model": BASE, "prompt": PROMPT, "max_tokens": 2, "sim_output_tokens": 2}
        await post(client, decode.url, body, {PREFILLER_HEADER: f"127.0.0.1:{port}", **trace})
    finally:
        await runner.cleanup()
    (received,) = seen
    assert {k: received.get(k) for k in trace} == trace
