"""The demo's traffic: the same plan sends the same requests, in the shapes each workload names."""

from __future__ import annotations

from typing import Any

import pytest

from policyd.demo.traffic import (
    CRITICALITY_HEADER,
    Traffic,
    TrafficPlan,
    Workload,
    groups,
    request_of,
)
from policyd.sim import L4_LLAMA2_7B, adapter_names
from policyd.sim.tokenizer import tokenize, tokenize_chat

ADAPTERS = adapter_names(12)
BASE = L4_LLAMA2_7B.base_model


def plan(workload: Workload = "mixed", seed: int = 0) -> TrafficPlan:
    return TrafficPlan(adapters=ADAPTERS, base_model=BASE, workload=workload, seed=seed)


def requests(p: TrafficPlan, count: int = 300) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    shared = groups(p)
    return [request_of(p, index, shared) for index in range(count)]


def prompt_tokens(body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        return tokenize_chat(body["messages"])
    return tokenize(body["prompt"])


def test_the_same_plan_sends_the_same_requests_in_any_order() -> None:
    forward = requests(plan())
    traffic = Traffic("http://unused", plan())
    backward = [traffic.request(index) for index in reversed(range(300))]
    assert forward == backward[::-1]
    assert requests(plan(seed=1)) != forward


@pytest.mark.parametrize("workload", ["mixed", "shared-prefix"])
def test_every_prompt_starts_with_one_of_a_handful_of_long_system_prompts(
    workload: Workload,
) -> None:
    p = plan(workload)
    shared = groups(p)
    assert len({g.system_prompt for g in shared}) == p.groups == 6
    lengths = sorted(len(g.system_prompt.split()) for g in shared)
    assert lengths[0] >= 300 and lengths[-1] <= 1000 + 12  # + the team's sentence
    seen = set()
    for _, body, _ in requests(p):
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        (group,) = [g for g in shared if text.startswith(g.system_prompt)]
        assert ("messages" in body) == group.chat  # a group's application uses one API
        seen.add(group.name)
    assert seen == {g.name for g in shared}


def test_mixed_names_the_adapters_with_skewed_popularity_and_shared_prefix_only_the_base() -> None:
    mixed = [body["model"] for _, body, _ in requests(plan("mixed"))]
    assert set(mixed) == {*ADAPTERS, BASE}
    assert mixed.count(ADAPTERS[0]) > 3 * mixed.count(ADAPTERS[-1])
    assert {body["model"] for _, body, _ in requests(plan("shared-prefix"))} == {BASE}


def test_lora_sends_short_prompts_of_their_own() -> None:
    bodies = [body for _, body, _ in requests(plan("lora"))]
    assert {body["model"] for body in bodies} == {*ADAPTERS, BASE}
    assert max(len(prompt_tokens(body)) for body in bodies) <= 61 + 6  # words, BOS, "user:"


@pytest.mark.parametrize("workload", ["mixed", "shared-prefix", "lora"])
def test_chat_completions_streams_and_criticalities_are_all_sent(workload: Workload) -> None:
    sent = requests(plan(workload))
    paths = {path for path, _, _ in sent}
    assert paths == {"/v1/chat/completions", "/v1/completions"}
    streams = [body for _, body, _ in sent if body.get("stream")]
    assert 0.2 < len(streams) / len(sent) < 0.4
    assert all(body["stream_options"] == {"include_usage": True} for body in streams)
    critical = [h for _, _, h in sent if h.get(CRITICALITY_HEADER) == "critical"]
    assert 0.2 < len(critical) / len(sent) < 0.4
    assert [h["x-demo-request"] for _, _, h in sent[:2]] == ["r001", "r002"]


def test_the_prompts_fit_a_simulated_pod() -> None:
    """A prompt and its answer fit the model's context; one model's system prompts take
    at most half a pod's KV cache, so a pod holds them with room for the requests."""
    p = plan("mixed")
    profile = L4_LLAMA2_7B
    longest = max(len(prompt_tokens(body)) for _, body, _ in requests(p))
    assert longest + p.max_tokens[1] <= profile.max_model_len
    prefix_blocks = sum(len(tokenize(g.system_prompt)) // profile.block_size for g in groups(p))
    assert prefix_blocks <= profile.num_gpu_blocks / 2
