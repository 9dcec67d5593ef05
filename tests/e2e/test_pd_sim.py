"""P/D end to end on simulated pods: the real Envoy, ``policyd serve`` with rules/pd.yaml
and a pool of a prefill pod and a decode pod doing the P/D sidecar's part in-process.

A long prompt is split: policyd names the prefill pod to the decode pod, which has
it prefill (one token, its blocks handed over) and then decodes; each pod's
``/metrics`` shows its part. A short prompt is not split: the prefill pod does nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_serve_process import wait_ready

from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import free_port, start_envoy
from policyd.sim import SimPool
from policyd.sim.profile import H100_LLAMA31_8B
from policyd.sim.server import SimServer

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

REPO = Path(__file__).resolve().parents[2]
MODEL = H100_LLAMA31_8B.base_model
LONG = "a shared document " * 400  # 1,201 tokens to the pods, about 1,800 to policyd
SHORT = "hello there"


async def counters(client: aiohttp.ClientSession, server: SimServer) -> dict[str, float]:
    """The pod's token and request counters, as its /metrics shows them."""
    async with client.get(server.url + "/metrics") as response:
        text = await response.text()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
                found[sample.name] = sample.value
            if sample.name == "vllm:request_success_total":
                found["requests"] = found.get("requests", 0.0) + sample.value
    return found


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


async def test_a_long_prompt_is_prefilled_on_the_prefill_pod_and_decoded_on_the_decode_pod(
    tmp_path: Path,
) -> None:
    async with SimPool(
        2,
        base_port=0,
        profile=H100_LLAMA31_8B,
        adapters=0,
        time_scale=10,
        roles=["prefill", "decode"],
        pd_in_process=True,
    ) as sim:
        prefill, decode = sim.servers
        pods = tmp_path / "pods.yaml"
        pods.write_text(sim.pods_yaml())
        port = free_port()
        command = [
            sys.executable, "-m", "policyd", "serve",
            "--policy", str(REPO / "rules" / "pd.yaml"), "--pods", str(pods),
            "--port", str(port), "--scrape-interval", "0.05", "--stale-after", "2",
            "--grace-seconds", "1",
        ]  # fmt: skip
        process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        envoy = None
        try:
            await wait_ready(port, process)
            envoy = await start_envoy(
                tmp_path, EnvoyConfigOptions(port=0, admin_port=0, policyd_port=port)
            )
            url = f"http://127.0.0.1:{envoy.listen_port}/v1/completions"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
                before = {s.name: await counters(client, s) for s in sim.servers}
                body = {"model": MODEL, "prompt": LONG, "max_tokens": 6, "sim_output_tokens": 6}
                async with client.post(url, json=body) as response:
                    assert response.status == 200, await response.text()
                    answer = await response.json()
                assert answer["usage"]["completion_tokens"] == 6
                on_prefill = delta(await counters(client, prefill), before[prefill.name])
                on_decode = delta(await counters(client, decode), before[decode.name])
                # The prefill pod computed the prompt and wrote one token for the decode pod.
                assert on_prefill == {
                    "vllm:prompt_tokens_total": 1201,
                    "vllm:generation_tokens_total": 1,
                    "requests": 1,
                }
                # The decode pod served the client: the prompt (its KV received) and 6 tokens.
                assert on_decode == {
                    "vllm:prompt_tokens_total": 1201,
                    "vllm:generation_tokens_total": 6,
                    "requests": 1,
                }
                before = {s.name: await counters(client, s) for s in sim.servers}
                short = {"model": MODEL, "prompt": SHORT, "max_tokens": 2, "sim_output_tokens": 2}
                async with client.post(url, json=short) as response:
                    assert response.status == 200, await response.text()
                assert delta(await counters(client, prefill), before[prefill.name]) == {
                    "vllm:prompt_tokens_total": 0,
                    "vllm:generation_tokens_total": 0,
                    "requests": 0,
                }
                assert delta(await counters(client, decode), before[decode.name])["requests"] == 1
        finally:
            if envoy is not None:
                envoy.stop()
            process.terminate()
            process.wait(timeout=30)
