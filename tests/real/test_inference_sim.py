"""policyd against llm-d's inference-sim, a vLLM simulator nobody here wrote.

Every request goes through the real Envoy and a ``policyd serve`` process to
inference-sim processes (``inference_sim.py``), and every answer is checked
twice: what the client got, and what policyd's decision log says it decided on
(the pods' metrics as policyd read them) and saw come back. The tests cover
routing with every shipped policy, LoRA affinity over the simulator's
``vllm:lora_requests_info``, precise prefix matching from its KV events (its
own encoding: a parent hash of 0 for a sequence's first block, and events as
maps of field names), and its failure injection. docs/model-servers.md says
what the simulator showed about policyd's assumptions.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from inference_sim import (
    MODEL,
    READY_S,
    REPO,
    Gateway,
    SimPod,
    gateway,
    pod_metrics,
    start_pod,
    stop_pods,
    until_ready,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

POLICIES = sorted(p for p in (REPO / "rules").glob("*.yaml") if not p.name.endswith(".test.yaml"))
ADAPTERS = ("lora-a", "lora-b")
LORA_FLAGS = (
    "--lora-modules",
    *(json.dumps({"name": name, "path": f"/adapters/{name}"}) for name in ADAPTERS),
)
RUNNING = "vllm:num_requests_running"
FAST = ("--time-to-first-token", "5ms", "--inter-token-latency", "2ms", "--seed", "7")


@pytest.fixture(scope="module")
def inference_sim(tool: Callable[[str], str]) -> str:
    return tool("inference-sim")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=READY_S)) as session:
        yield session


async def until(condition: Callable[[], Any], what: str) -> None:
    """Poll ``condition`` (a plain or async callable) until it is true."""
    deadline = time.monotonic() + READY_S
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def post(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[int, dict[str, Any]]:
    async with client.post(url + path, json=body) as response:
        return response.status, await response.json(content_type=None)


def success_total(samples: dict[str, list[Any]]) -> float:
    return float(sum(s.value for s in samples.get("vllm:request_success_total", ())))


def inputs_of(decision: dict[str, Any], pod: str) -> dict[str, Any]:
    """What the policy read of ``pod`` for this decision."""
    (inputs,) = [p for p in decision["pods"] if p["name"] == pod]
    return dict(inputs)


async def settled(gate: Gateway, count: int) -> list[dict[str, Any]]:
    """The decision log once it holds ``count`` decisions (each is logged as its
    exchange ends, with the response)."""
    await until(lambda: len(gate.decisions()) >= count, f"{count} decisions logged")
    return gate.decisions()


# -- routing with every shipped policy --------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def lora_pods(
    inference_sim: str, client: aiohttp.ClientSession, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[list[SimPod]]:
    tmp = tmp_path_factory.mktemp("pods")
    pods = [
        start_pod(inference_sim, f"sim-{i}", tmp, *LORA_FLAGS, "--max-loras", "2", *FAST)
        for i in range(2)
    ]
    try:
        await until_ready(client, pods)
        yield pods
    finally:
        await stop_pods(pods)


@pytest.mark.parametrize("policy", POLICIES, ids=[p.stem for p in POLICIES])
async def test_every_shipped_policy_routes_to_the_inference_sim(
    policy: Path, lora_pods: list[SimPod], client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    before = [success_total(await pod_metrics(client, pod.url)) for pod in lora_pods]
    async with gateway(tmp_path, policy, lora_pods) as gate:
        requests = [
            ("/v1/completions", {"model": MODEL, "prompt": "the base model", "max_tokens": 3}),
            ("/v1/completions", {"model": "lora-a", "prompt": "an adapter", "max_tokens": 3}),
            (
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            ),
        ]
        for path, body in requests:
            status, answer = await post(client, gate.url, body, path)
            assert status == 200, answer
            assert answer["model"] == body["model"] and answer["choices"]
        decisions = await settled(gate, len(requests))
    after = [success_total(await pod_metrics(client, pod.url)) for pod in lora_pods]
    addresses = {pod.name: pod.address for pod in lora_pods}
    for decision, (_, body) in zip(decisions, requests, strict=True):
        assert decision["outcome"] == "routed" and decision["response"]["status"] == 200
        assert decision["request"]["target_model"] == body["model"]
        assert decision["endpoint"] == addresses[decision["pod"]]
        for pod in lora_pods:  # what policyd read from the simulator's metrics
            inputs = inputs_of(decision, pod.name)
            assert inputs["base_model"] == MODEL and inputs["max_loras"] == 2
    # The simulators served exactly what policyd routed, on the pods it chose.
    served = {pod.name: a - b for pod, a, b in zip(lora_pods, after, before, strict=True)}
    routed = {pod.name: sum(d["pod"] == pod.name for d in decisions) for pod in lora_pods}
    assert served == routed


# -- LoRA affinity ---------------------------------------------------------------------------


async def test_lora_affinity_follows_the_adapters_the_inference_sim_runs(
    inference_sim: str, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # One adapter slot per pod (--max-loras 1): the seed tree (default.yaml) sends an
    # adapter's requests to the pod running it, and another adapter's to the other pod.
    flags = (*LORA_FLAGS, "--max-loras", "1", "--time-to-first-token", "5ms")
    flags += ("--inter-token-latency", "100ms")
    pods = [start_pod(inference_sim, f"lora-{i}", tmp_path, *flags) for i in range(2)]
    try:
        await until_ready(client, pods)
        async with gateway(tmp_path, REPO / "rules" / "default.yaml", pods) as gate:
            held = {"model": "lora-a", "prompt": "a long generation", "stream": True}
            # ~90 s (within the simulator's context of 1,024 tokens), cut short below
            held |= {"max_tokens": 900, "ignore_eos": True}
            async with client.post(gate.url + "/v1/completions", json=held) as stream:
                assert stream.status == 200, await stream.text()
                await stream.content.readline()  # the first chunk: it runs
                running = [
                    sum(s.value for s in (await pod_metrics(client, pod.url))[RUNNING])
                    for pod in pods
                ]
                assert sorted(running) == [0, 1]
                home = pods[running.index(1)].name
                other = pods[running.index(0)].name
                seen = dict.fromkeys(ADAPTERS, 0)
                while min(seen.values()) < 3:
                    for adapter in ADAPTERS:
                        logged = len(gate.decisions())
                        body = {"model": adapter, "prompt": "short", "max_tokens": 2}
                        status, answer = await post(client, gate.url, body)
                        assert status == 200, answer
                        decision = (await settled(gate, logged + 1))[-1]
                        assert decision["request"]["target_model"] == adapter
                        inputs = inputs_of(decision, home)
                        if inputs["active_loras"] == ["lora-a"] and inputs["max_loras"] == 1:
                            # policyd sees the held adapter run at home, its one slot taken
                            assert decision["pod"] == (home if adapter == "lora-a" else other)
                            seen[adapter] += 1

            # The held stream, cut short, is logged as it ended: it ran at home.
            def streamed() -> list[dict[str, Any]]:
                return [d for d in gate.decisions() if d["request"]["stream"]]

            await until(streamed, "the held stream's decision")
            (stream_decision,) = streamed()
            assert stream_decision["pod"] == home
    finally:
        await stop_pods(pods)
