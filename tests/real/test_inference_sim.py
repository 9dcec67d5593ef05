"""policyd against llm-d's inference-sim, a vLLM simulator nobody here wrote.

Every request goes through the real Envoy and a ``policyd serve`` process to
inference-sim processes (``inference_sim.py``), and every answer is checked
twice: what the client got, and what policyd's decision log says it decided on
(the pods' metrics as policyd read them) and saw come back. The tests cover
routing with every shipped policy, LoRA affinity over the simulator's
``vllm:lora_requests_info``, precise prefix matching from its KV events (its
own encoding: a parent hash of 0 for a sequence's first block, and events as
maps of field names) and from its replay socket (replies that carry the
topic), and its failure injection. docs/model-servers.md says
what the simulator showed about policyd's assumptions.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
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
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.asyncio(loop_scope="module")

POLICIES = sorted(p for p in (REPO / "rules").glob("*.yaml") if not p.name.endswith(".test.yaml"))
ADAPTERS = ("lora-a", "lora-b")
LORA_FLAGS = (
    "--lora-modules",
    *(json.dumps({"name": name, "path": f"/adapters/{name}"}) for name in ADAPTERS),
)
RUNNING = "vllm:num_requests_running"
ACTIVE_LORAS = "policyd_pod_active_lora_adapters"
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
    addresses = {pod.name: pod.address for pod in lora_pods}
    for decision, (_, body) in zip(decisions, requests, strict=True):
        assert decision["outcome"] == "routed" and decision["response"]["status"] == 200
        assert decision["request"]["target_model"] == body["model"]
        assert decision["endpoint"] == addresses[decision["pod"]]
        for pod in lora_pods:  # what policyd read from the simulator's metrics
            inputs = inputs_of(decision, pod.name)
            assert inputs["base_model"] == MODEL and inputs["max_loras"] == 2
    # The simulators served exactly what policyd routed, on the pods it chose (each counts
    # a request a moment after its answer).
    routed = [sum(d["pod"] == pod.name for d in decisions) for pod in lora_pods]

    async def served_as_routed() -> bool:
        after = [success_total(await pod_metrics(client, pod.url)) for pod in lora_pods]
        return [a - b for a, b in zip(after, before, strict=True)] == routed

    await until(served_as_routed, f"the pods to count {routed} requests")


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

                # Until policyd sees lora-a run at home, only lora-a: another adapter sent
                # there would wait for the slot. The simulator stamps its LoRA series to
                # the second, so the held request's waiting and running series may tie
                # (docs/model-servers.md) until a lora-a request at home sets one again.
                async def seen_at_home() -> bool:
                    if await per_pod(client, gate, ACTIVE_LORAS, home) == 1:
                        return True
                    body = {"model": "lora-a", "prompt": "short", "max_tokens": 2}
                    assert (await post(client, gate.url, body))[0] == 200
                    return False

                await until(seen_at_home, "policyd to see lora-a run at home")
                await until(  # and none at the other pod, where a probe may have gone
                    lambda: _equals(per_pod(client, gate, ACTIVE_LORAS, other), 0),
                    "policyd to see no adapter run at the other pod",
                )
                seen = dict.fromkeys(ADAPTERS, 0)
                deadline = time.monotonic() + READY_S  # within the held stream's ~90 s
                while min(seen.values()) < 3:
                    assert time.monotonic() < deadline, f"policyd saw lora-a at home {seen}"
                    for adapter in ADAPTERS:
                        logged = len(gate.decisions())
                        body = {"model": adapter, "prompt": "short", "max_tokens": 2}
                        status, answer = await post(client, gate.url, body)
                        assert status == 200, answer
                        decision = (await settled(gate, logged + 1))[-1]
                        assert decision["request"]["target_model"] == adapter
                        at_home, elsewhere = inputs_of(decision, home), inputs_of(decision, other)
                        # The pods as this decision saw them: the held adapter running at
                        # home, its one slot taken; the other pod running at most lora-b
                        # (a probe may have gone there before policyd saw the home).
                        if (
                            at_home["active_loras"] == ["lora-a"]
                            and at_home["max_loras"] == 1
                            and set(elsewhere["active_loras"]) <= {"lora-b"}
                        ):
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


# -- precise prefix matching from the simulator's KV events ----------------------------------


def ids(start: int, count: int) -> list[int]:
    """A token-id prompt: policyd keys the ids as given, the simulator caches them as given."""
    return list(range(start, start + count))


async def per_pod(client: aiohttp.ClientSession, gate: Gateway, name: str, pod: str) -> float:
    """The value policyd's own /metrics gives ``pod`` in the family ``name``."""
    samples = (await pod_metrics(client, gate.monitoring_url)).get(name)
    return sum(s.value for s in samples or () if s.labels["model_server_endpoint"] == pod)


BLOCKS = "policyd_prefix_index_blocks"
BATCHES = "policyd_prefix_kv_event_batches_total"  # applied, live and replayed


@pytest.mark.parametrize("encoding", [(), ("--use-vllm-map-event-format",)], ids=["arrays", "maps"])
async def test_precise_mode_follows_the_inference_sims_kv_events(
    encoding: tuple[str, ...], inference_sim: str, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # A KV cache of 64 blocks of 16 tokens per pod; one event per batch, so that each
    # request bringing new blocks is one batch and each block evicted one more. What a
    # pod published before policyd followed it comes from its replay socket: policyd has
    # applied all a pod published once its count of batches is that many.
    flags = ("--block-size", "16", "--kv-cache-size", "64", "--event-batch-size", "1", *FAST)
    pods = [
        start_pod(
            inference_sim, f"kv-{i}", tmp_path, *flags, *encoding, kv_events=True, replay=True
        )
        for i in range(2)
    ]
    try:
        await until_ready(client, pods)
        policy = REPO / "rules" / "prefix-aware.yaml"
        async with gateway(tmp_path, policy, pods, "--prefix-index", "precise") as gate:

            async def applied(pod: SimPod, count: int) -> None:
                await until(
                    lambda: _equals(per_pod(client, gate, BATCHES, pod.name), count),
                    f"{count} batches of {pod.name} applied",
                )

            # Two ZMQ hops join late (the pod dials the relay once a second, a SUB's
            # subscription arrives after it connects): one-block prompts until policyd
            # has a message from each pod.
            probes = {pod.name: 0 for pod in pods}
            for n, pod in enumerate(pods):
                await until(
                    lambda n=n, pod=pod: probed(client, gate, pod, probes, 10_000 * (n + 1)),
                    f"a batch of {pod.name} applied",
                )
            # Each pod is warmed directly, past policyd, with its own 3-block prompt.
            prompts = {pod.name: ids(100_000 * (n + 1), 48) for n, pod in enumerate(pods)}
            for pod in pods:
                body = {"model": MODEL, "prompt": prompts[pod.name], "max_tokens": 1}
                assert (await post(client, pod.url, body))[0] == 200
                await applied(pod, probes[pod.name] + 1)
                assert await per_pod(client, gate, BLOCKS, pod.name) == probes[pod.name] + 3
            # Through Envoy, each prompt (and 8 tokens more) goes to the pod holding it.
            for pod in pods:
                logged = len(gate.decisions())
                body = {"model": MODEL, "prompt": prompts[pod.name] + ids(1, 8), "max_tokens": 1}
                status, answer = await post(client, gate.url, body)
                assert status == 200, answer
                decision = (await settled(gate, logged + 1))[-1]
                assert decision["pod"] == pod.name
                assert decision["prefix_match"] == pytest.approx(48 / 56)
            # Evicted blocks leave the index: 64 new blocks fill the first pod's cache and
            # evict the probes' and the prompt's (a batch each).
            first = pods[0]
            for n in range(4):
                body = {"model": MODEL, "prompt": ids(500_000 + 256 * n, 256), "max_tokens": 1}
                assert (await post(client, first.url, body))[0] == 200
            evicted = probes[first.name] + 3
            await applied(first, probes[first.name] + 1 + 4 + evicted)
            assert await per_pod(client, gate, BLOCKS, first.name) == 64
            logged = len(gate.decisions())
            body = {"model": MODEL, "prompt": prompts[first.name], "max_tokens": 1}
            assert (await post(client, gate.url, body))[0] == 200
            decision = (await settled(gate, logged + 1))[-1]
            assert decision["best_prefix_match"] == 0
    finally:
        await stop_pods(pods)


async def _equals(value: Awaitable[float], expected: float) -> bool:
    return await value == expected


async def test_precise_mode_replays_what_the_inference_sim_published_before_policyd_followed(
    inference_sim: str, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # The first message policyd gets from a pod makes it ask the pod's replay socket for
    # what came before; the inference-sim answers in llm-d's framing (the topic first).
    # One event per batch: the simulator publishes a batch when it is full or a second
    # after its first event, so the early prompt's goes out before policyd follows.
    flags = ("--block-size", "16", "--kv-cache-size", "64", "--event-batch-size", "1", *FAST)
    pods = [
        start_pod(inference_sim, f"replay-{i}", tmp_path, *flags, kv_events=True, replay=True)
        for i in range(2)
    ]
    try:
        await until_ready(client, pods)
        early = ids(200_000, 48)  # sent to the first pod before anyone follows its events
        body = {"model": MODEL, "prompt": early, "max_tokens": 1}
        assert (await post(client, pods[0].url, body))[0] == 200
        policy = REPO / "rules" / "prefix-aware.yaml"
        async with gateway(tmp_path, policy, pods, "--prefix-index", "precise") as gate:
            probes = {pods[0].name: 0}
            await until(
                lambda: probed(client, gate, pods[0], probes, 300_000), "a batch of the pod applied"
            )
            logged = len(gate.decisions())
            body = {"model": MODEL, "prompt": early + ids(1, 8), "max_tokens": 1}
            status, answer = await post(client, gate.url, body)
            assert status == 200, answer
            decision = (await settled(gate, logged + 1))[-1]
            assert decision["pod"] == pods[0].name
            assert decision["prefix_match"] == pytest.approx(48 / 56)
            replayed = (await pod_metrics(client, gate.monitoring_url))[
                "policyd_prefix_kv_event_replayed_batches_total"
            ]
            assert any(
                s.labels["model_server_endpoint"] == pods[0].name and s.value > 0 for s in replayed
            )
    finally:
        await stop_pods(pods)


async def probed(
    client: aiohttp.ClientSession, gate: Gateway, pod: SimPod, sent: dict[str, int], base: int
) -> bool:
    """Whether policyd has applied a batch of ``pod``; if not, one more one-block prompt
    (counted in ``sent``)."""
    if await per_pod(client, gate, BATCHES, pod.name) > 0:
        return True
    body = {"model": MODEL, "prompt": ids(base + 16 * sent[pod.name], 16), "max_tokens": 1}
    status, answer = await post(client, pod.url, body)
    assert status == 200, answer
    sent[pod.name] += 1
    await asyncio.sleep(0.2)
    return False


# -- failure injection ------------------------------------------------------------------------


async def test_injected_failures_reach_the_client_as_the_pod_sent_them(
    inference_sim: str, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # One pod fails every request with one of the simulator's OpenAI errors (429, 401,
    # 400, 503, 404); round-robin alternates the pods. Envoy retries no answer a pod gave,
    # so each error reaches the client as the pod sent it, policyd logs it as the answer
    # to a routed request, and keeps routing.
    pods = [
        start_pod(inference_sim, "flaky", tmp_path, "--failure-injection-rate", "100", *FAST),
        start_pod(inference_sim, "healthy", tmp_path, *FAST),
    ]
    try:
        await until_ready(client, pods)
        async with gateway(tmp_path, REPO / "rules" / "round-robin.yaml", pods) as gate:
            answers = []
            for n in range(8):
                logged = len(gate.decisions())
                body = {"model": MODEL, "prompt": f"request {n}", "max_tokens": 2}
                answers.append(await post(client, gate.url, body))
                await settled(gate, logged + 1)
            decisions = gate.decisions()
            async with client.get(gate.monitoring_url + "/metrics") as response:
                metrics = await response.text()
    finally:
        await stop_pods(pods)
    assert [d["pod"] for d in decisions].count("flaky") == 4
    for (status, answer), decision in zip(answers, decisions, strict=True):
        assert decision["outcome"] == "routed"
        assert decision["response"]["status"] == status
        if decision["pod"] == "flaky":
            assert status in (400, 401, 404, 429, 503)
            assert answer["error"]["code"] == status and answer["error"]["message"]
        else:
            assert status == 200 and answer["choices"]
        # A failed request leaves no count behind: the requests went one at a time, so a
        # pod's in-flight count (logged just after the decision, settled a few
        # milliseconds after the reply) is at most the request itself.
        assert all(p["in_flight"] <= 1 for p in decision["pods"])
    classes = {
        s.labels["status_class"]: s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "policyd_responses"
        for s in family.samples
        if s.name == "policyd_responses_total"
    }
    assert classes.get("2xx") == 4
    assert classes.get("4xx", 0) + classes.get("5xx", 0) == 4
