"""A chat stream's first bytes come with its first token, as vLLM sends them.

vLLM writes a chat stream's opening chunk (the assistant's role) on the
request's first engine output; whoever times the first body bytes (policyd's
latency models and objectives, a client's TTFT) then times the first token.
"""

from __future__ import annotations

import json

import aiohttp

from policyd.sim.server import SimServer


async def test_the_role_opens_a_chat_stream_only_with_the_first_token() -> None:
    pod = SimServer(port=0, time_scale=1.0, seed=3)  # a 2,000-token prefill: ~0.4 s
    await pod.start()
    try:
        payload = {
            "model": "adapter-1",
            "messages": [{"role": "user", "content": " ".join(["word"] * 2000)}],
            "max_tokens": 50,
            "stream": True,
        }
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client,
            client.post(pod.url + "/v1/chat/completions", json=payload) as response,
        ):
            assert response.status == 200
            first = await response.content.readany()
            (state,) = pod.driver.engine.running  # 50 tokens: still decoding
            assert state.generated >= 1 and state.first_token_at is not None
            events = [e for e in first.split(b"\n\n") if e]
            opening = json.loads(events[0][len(b"data: ") :])
            assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            rest = first + await response.read()
    finally:
        await pod.stop()
    events = [e for e in rest.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert len(events) == 1 + 50 + 1  # the role, a chunk per token, [DONE]
