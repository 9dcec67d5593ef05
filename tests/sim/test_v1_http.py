"""A V1 pod (``h100-llama3.1-8b``) over real HTTP on loopback, sped up: generated tokens
are cached for a client resending the conversation, and lengths are drawn below the cap."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from policyd.sim.profile import H100_LLAMA31_8B
from policyd.sim.server import SimServer

TIME_SCALE = 10.0
BASE = H100_LLAMA31_8B.base_model
BLOCK = H100_LLAMA31_8B.block_size
QUESTION = " ".join(f"word{i}" for i in range(60))  # 61 tokens with the BOS


@pytest.fixture
async def server() -> AsyncIterator[SimServer]:
    pod = SimServer(H100_LLAMA31_8B, port=0, time_scale=TIME_SCALE, seed=5)
    await pod.start()
    try:
        yield pod
    finally:
        await pod.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


async def post(
    client: aiohttp.ClientSession, server: SimServer, path: str, payload: dict[str, Any]
) -> dict[str, Any]:
    async with client.post(server.url + path, json=payload) as response:
        assert response.status == 200, await response.text()
        body: dict[str, Any] = await response.json()
        return body


async def test_a_resent_reply_hits_the_blocks_the_pod_generated(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    # The reply's length is drawn below max_tokens; take the first long enough to fill
    # blocks of its own (the pod's generator is seeded, so this is the same every run).
    for attempt in range(10):
        prompt = f"Question {attempt}: {QUESTION}"
        first = await post(
            client, server, "/v1/completions", {"model": BASE, "prompt": prompt, "max_tokens": 64}
        )
        generated = first["usage"]["completion_tokens"]
        if generated > 40:
            break
    else:
        pytest.fail("no reply of more than 40 tokens in 10 tries")
    asked = first["usage"]["prompt_tokens"]
    follow_up = prompt + first["choices"][0]["text"] + " Tell me more about it."
    second = await post(
        client, server, "/v1/completions", {"model": BASE, "prompt": follow_up, "max_tokens": 4}
    )
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # every full block of the first turn: its prompt and all but its last generated token
    assert cached == (asked + generated - 1) // BLOCK * BLOCK
    assert cached > asked // BLOCK * BLOCK + BLOCK  # at least one block of the reply


async def test_chat_without_max_tokens_completes_with_a_drawn_length(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    lengths = []
    for i in range(6):
        body = await post(
            client,
            server,
            "/v1/chat/completions",
            {"model": BASE, "messages": [{"role": "user", "content": f"Hello number {i}"}]},
        )
        assert body["choices"][0]["finish_reason"] == "stop"
        lengths.append(body["usage"]["completion_tokens"])
    profile = H100_LLAMA31_8B
    assert all(profile.output_tokens_min <= n <= profile.output_tokens_max for n in lengths)
    assert len(set(lengths)) > 1


async def test_completions_stop_on_their_own_below_max_tokens(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    ends = []
    for i in range(12):
        body = await post(
            client,
            server,
            "/v1/completions",
            {"model": BASE, "prompt": f"Count to {i}", "max_tokens": 40},
        )
        ends.append((body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]))
    # a text of exactly 40 tokens stops on its own too; a longer one is cut at 40
    assert all(
        n <= 40 if reason == "stop" else reason == "length" and n == 40 for n, reason in ends
    )
    assert sum(1 for n, reason in ends if reason == "stop" and n < 40) >= 4


async def test_a_chat_follow_up_hits_the_reply_the_pod_generated(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    # vLLM renders a chat request with the template's generation prompt (the
    # assistant's opening line), so the resent reply follows the tokens the pod computed.
    for attempt in range(10):
        history = [{"role": "user", "content": f"Question {attempt}: {QUESTION}"}]
        first = await post(
            client,
            server,
            "/v1/chat/completions",
            {"model": BASE, "messages": history, "max_tokens": 64},
        )
        generated = first["usage"]["completion_tokens"]
        if generated > 40:
            break
    else:
        pytest.fail("no reply of more than 40 tokens in 10 tries")
    asked = first["usage"]["prompt_tokens"]
    history += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Tell me more about it."},
    ]
    second = await post(
        client,
        server,
        "/v1/chat/completions",
        {"model": BASE, "messages": history, "max_tokens": 4},
    )
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (asked + generated - 1) // BLOCK * BLOCK
    assert cached > asked // BLOCK * BLOCK + BLOCK
