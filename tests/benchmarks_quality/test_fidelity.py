"""Virtual time sees what ``policyd serve`` sees: the same requests and the same pods.

``benchmarks/live.py`` compares live runs with their virtual twins
(``quality.py``'s runners) on the same seeds. These tests fail when the
runner drifts from the serving path on the inputs of a decision, for a
small deterministic case and with no clock in any assertion:

- the request: what the live client (``live_stack``) puts on the wire,
  parsed by the serving path's own parser, against what the runner hands
  the router. Catches a runner that counts the prompt with the pods'
  tokenizer where ``policyd serve`` estimates it (a quarter more tokens on
  the chat workloads, which moves ``rules/flow.yaml``'s KV footprint), that
  leaves out the stream flag, the path or the client's headers, or that
  tokenizes the prompt for prefix matching otherwise than the live stack's
  ``policyd serve`` (``--prefix-tokenizer``);
- the pod: a simulated pod's ``/metrics`` exposition, read by policyd's own
  metrics parser, against the runner's view of the same engine state.
  Catches adapters, queues, KV use or the LoRA limit reported differently.
- the decision: the same router on both sides' inputs picks the same pods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import web
from benchmarks_support import load_benchmark
from prometheus_client import CollectorRegistry, generate_latest

from policyd.extproc.openai import InferenceBody, parse_body
from policyd.fields.roles import BOTH
from policyd.policy import PolicyStore, Router
from policyd.pool.exposition import MetricsParser
from policyd.pool.metric_names import VLLM
from policyd.pool.pod import Pod
from policyd.prefix.tokenizers import tokenizer_from_spec
from policyd.sim.api import OUTPUT_TOKENS_FIELD
from policyd.sim.engine import SimRequest
from policyd.sim.experiment import (
    PodView,
    RoutedRequest,
    SeedWorkload,
    pod_views,
)
from policyd.sim.exposition import EngineCollector
from policyd.sim.names import pod_name
from policyd.sim.open_loop import run_open_loop
from policyd.sim.profile import L4_LLAMA2_7B
from policyd.sim.virtual import VirtualLoop, VirtualPod
from policyd.sim.workloads import SharedPrefix

REPO = Path(__file__).resolve().parents[2]
SEED = 7
SMALL_SEED = SeedWorkload(requests=8, connections=4, max_tokens=60)


@pytest.fixture(scope="module")
def live() -> ModuleType:
    return load_benchmark("live")


# --- the request -----------------------------------------------------------------------------


async def _sent(client: Any, *arguments: Any, **keywords: Any) -> list[tuple[str, bytes, dict]]:
    """What a live client puts on the wire: path, body and headers of each request, in the
    order sent, to a stand-in server that answers every one with a 503."""
    seen: list[tuple[str, bytes, dict]] = []

    async def record(request: web.Request) -> web.Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        seen.append((request.path, await request.read(), headers))
        return web.json_response({"error": {"code": "stand_in"}}, status=503)

    application = web.Application()
    application.router.add_post("/{tail:.*}", record)
    runner = web.AppRunner(application)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        await client(f"http://127.0.0.1:{port}", *arguments, **keywords)
    finally:
        await runner.cleanup()
    return seen


def _served(path: str, body: bytes, headers: Mapping[str, str]) -> InferenceBody:
    """The request as ``policyd serve`` reads it (headers as Envoy hands them over)."""
    return parse_body(body, path, headers=headers)


def _recording(route: Any) -> list[tuple[Any, Any]]:
    """Every (request, probe) the runner's router is asked to decide on."""
    decisions: list[tuple[Any, Any]] = []
    decide = route.router.decide

    def recorded(request: Any, pods: Any, probe: Any = None) -> Any:
        decisions.append((request, probe))
        return decide(request, pods, probe)

    route.router.decide = recorded
    return decisions


def _shape(request: Any) -> tuple[str, int, int]:
    return (request.model, request.prompt_tokens, request.max_tokens)


def _same_request(runner: Any, probe: Any, live: InferenceBody, tokenizer: str) -> None:
    request = live.request
    assert (runner.model, runner.prompt_tokens, runner.max_tokens) == (
        request.model,
        request.prompt_tokens,
        request.max_tokens,
    )
    assert (runner.stream, runner.path) == (request.stream, request.path)
    for name in ("x-gateway-inference-criticality", "x-tenant"):
        assert runner.headers.get(name) == request.headers.get(name)
    assert probe is not None
    assert probe.tokens == tuple(tokenizer_from_spec(tokenizer).encode(live.turns))


def test_the_seed_twin_reads_each_request_as_policyd_serve_does(
    live: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stack, routing = sys.modules["live_stack"], sys.modules["virtual_routing"]
    arguments = live.parse(["--workload", "seed", "--quick", "--pickers", "lora-prefix"])
    workload = live.seed_workload(arguments)
    adapters, lengths = live.seed_requests(workload, arguments.seed)
    wire = asyncio.run(_sent(stack.run_seed, workload, adapters, 1.0, lengths))
    assert len(wire) == workload.requests
    # Each pod is told the length the virtual run's pod writes (policyd passes it on unread).
    sent = sorted(
        (json.loads(body)["model"], json.loads(body)[OUTPUT_TOKENS_FIELD]) for _, body, _ in wire
    )
    assert sent == sorted(zip(adapters, lengths, strict=True))

    decisions: list[tuple[Any, Any]] = []
    run_experiment = routing.run_experiment

    def recording_run(route: Any, **keywords: Any) -> Any:
        found = _recording(route)
        result = run_experiment(route, **keywords)
        decisions.extend(found)
        return result

    monkeypatch.setattr(routing, "run_experiment", recording_run)
    cell = live.Cell("seed", "burst", 0.0, 1.0, "lora-prefix", 0)
    live.virtual_twin(cell, arguments, tmp_path)  # live.py's own twin of the cell
    runner = {int(request.id): (request, probe) for request, probe in decisions}
    assert sorted(runner) == list(range(workload.requests))
    # The live pool sends in its own order; each request names its adapter.
    by_model: dict[str, InferenceBody] = {}
    for path, body, headers in wire:
        served = _served(path, body, headers)
        by_model.setdefault(served.request.model, served)
    for index, adapter in enumerate(adapters):
        request, probe = runner[index]
        assert request.model == adapter
        _same_request(request, probe, by_model[adapter], stack.PREFIX_TOKENIZER)


def test_the_open_loop_runner_reads_each_request_as_policyd_serve_does(
    live: ModuleType,
) -> None:
    stack, quality = sys.modules["live_stack"], sys.modules["quality"]
    requests = SharedPrefix().requests(rate=2.0, duration_s=4.0, seed=SEED)[:6]
    wire = asyncio.run(
        _sent(
            stack.run_open,
            requests,
            base_model=L4_LLAMA2_7B.base_model,
            time_scale=1000.0,
            timeout_s=120.0,
            streamed=[True] * len(requests),
            critical_default=True,  # as live.py sends the prefix workloads
        )
    )
    route = quality.OpenPolicyRouting(
        REPO / "rules" / "lora-prefix.yaml",
        seed=SEED,
        mode=quality.APPROXIMATE,
        tokenizer=stack.PREFIX_TOKENIZER,
    )
    decisions = _recording(route)
    run_open_loop(route, requests, seed=SEED)
    assert len(decisions) == len(wire) == len(requests)
    # The live pool sends concurrently, in its own order: pair each request by its shape.
    served = sorted((_served(*sent) for sent in wire), key=lambda sent: _shape(sent.request))
    decisions.sort(key=lambda decided: _shape(decided[0]))
    assert len({_shape(request) for request, _ in decisions}) == len(requests)  # unambiguous
    for (request, probe), served_body in zip(decisions, served, strict=True):
        _same_request(request, probe, served_body, stack.PREFIX_TOKENIZER)
        # and the pod computes the very ids the probe keys its blocks with
        assert probe.tokens == requests[int(request.id)].prompt


# --- the pod ---------------------------------------------------------------------------------


def _busy_pod() -> tuple[VirtualPod, VirtualLoop]:
    """A pod with more adapters asked for than it has slots: some run, some wait."""
    loop = VirtualLoop()
    pod = VirtualPod(loop, L4_LLAMA2_7B, name=pod_name(3), seed=SEED)
    for i in range(12):
        pod.submit(SimRequest(f"r{i}", tuple(range(1, 40 + i)), 200, adapter=f"adapter-{i % 6}"))
    loop.run(until=5.0)  # past the first prefill and its adapter loads
    return pod, loop


def _scraped(pod: VirtualPod, address: str) -> Pod:
    """The pod as ``policyd serve`` publishes it: its /metrics page through the sim's
    exposition, read by policyd's parser, built as the datastore builds it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(lambda: pod.engine, L4_LLAMA2_7B.base_model, float))
    metrics = MetricsParser(VLLM).parse(generate_latest(registry))
    return Pod(pod.name, address, {}, BOTH, *metrics)


def _view(pod: VirtualPod, now: float, in_flight: int = 0) -> PodView:
    return pod_views([pod], [(pod.snapshot(), now)], [in_flight], now)[0]


SCRAPED_FIELDS = (
    "name",
    "waiting_queue",
    "running",
    "kv_cache",
    "active_loras",
    "waiting_loras",
    "max_loras",
    "lora_info_known",
    "num_preemptions",
    "base_model",
    "kv_cache_blocks",
    "kv_block_size",
)


def test_the_runner_sees_a_pod_as_policyd_scrapes_it(live: ModuleType) -> None:
    routing = sys.modules["virtual_routing"]
    pod, loop = _busy_pod()
    snapshot = pod.snapshot()
    assert snapshot.running_adapters and snapshot.waiting_adapters  # the case is not trivial
    runner = routing.pod_from_view(_view(pod, loop.now))
    scraped = _scraped(pod, runner.address)
    assert {f: getattr(runner, f) for f in SCRAPED_FIELDS} == {
        f: getattr(scraped, f) for f in SCRAPED_FIELDS
    }


def test_the_same_router_picks_the_same_pods_on_both_sides_inputs(live: ModuleType) -> None:
    stack, routing = sys.modules["live_stack"], sys.modules["virtual_routing"]
    loop = VirtualLoop()
    pods = []
    for i in range(6):  # pods in different states: idle, and running different adapters
        pod = VirtualPod(loop, L4_LLAMA2_7B, name=pod_name(i), seed=i)
        for j in range(i):
            pod.submit(SimRequest(f"{i}-{j}", tuple(range(1, 30)), 100, adapter=f"adapter-{i + j}"))
        pods.append(pod)
    loop.run(until=5.0)
    views = [dataclasses.replace(_view(p, loop.now), index=i) for i, p in enumerate(pods)]
    scraped = [_scraped(p, routing.pod_address(i)) for i, p in enumerate(pods)]
    adapters = live.seed_adapters(SMALL_SEED, 1)
    wire = asyncio.run(_sent(stack.run_seed, SMALL_SEED, adapters, 1.0))
    for policy in ("lora-balanced", "lora-prefix", "flow"):
        path = REPO / "rules" / f"{policy}.yaml"
        for index, (url_path, body, headers) in enumerate(wire):
            served = _served(url_path, body, headers)
            route = routing.PolicyRouting(path, seed=index, headers={})
            request = RoutedRequest(index, served.request.model, 0, SMALL_SEED.max_tokens, 0.0)
            by_runner = route(request, views, random.Random(0))
            by_serving = Router(PolicyStore.open(path), rng=random.Random(f"policy-{index}"))
            decision = by_serving.decide(served.request, scraped)
            assert pod_name(by_runner) == decision.pod, (policy, index)
