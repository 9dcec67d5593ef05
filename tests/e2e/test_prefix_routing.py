"""Prefix-cache routing through the real Envoy: a conversation returns to the pod holding it.

Six conversations, each with its own long system prompt, are sent in turns
under ``rules/prefix-aware.yaml``. In approximate mode policyd remembers where
it sent each prompt; in precise mode it learns what each simulated pod cached
from the pod's KV events over real ZMQ and msgpack (the pods publish them as
vLLM does) and matches with the pods' own tokenizer. Either way every later
turn goes to the pod that served the first, its decision shows the match, and
the pod reports the prompt's blocks as cached in its usage.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from e2e_rig import PolicydGateway, start_policyd_gateway, stop_policyd_gateway, until

from policyd.prefix.index import PreciseIndex
from policyd.prefix.options import PrefixSettings

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

REPO = Path(__file__).resolve().parents[2]
TEST_ID = "x-test-id"
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
]


def system_prompt(conversation: int) -> str:
    """About 250 words, different for each conversation from the first word on."""
    words = itertools.islice(itertools.cycle(WORDS), conversation, conversation + 250)
    return f"You are assistant number {conversation}. " + " ".join(words)


@pytest_asyncio.fixture(
    loop_scope="module",
    params=[
        PrefixSettings(mode="approximate"),
        PrefixSettings(mode="precise", tokenizer="sim"),
    ],
    ids=["approximate", "precise"],
)
async def gateway(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> AsyncIterator[PolicydGateway]:
    tmp = tmp_path_factory.mktemp("prefix")
    rig = await start_policyd_gateway(
        tmp, REPO / "rules" / "prefix-aware.yaml", time_scale=20.0, prefix=request.param
    )
    try:
        yield rig
    finally:
        await stop_policyd_gateway(rig)


async def ask(gateway: PolicydGateway, conversation: int, turn: int) -> dict[str, Any]:
    body = {
        "model": "meta-llama/Llama-2-7b-hf",
        "messages": [
            {"role": "system", "content": system_prompt(conversation)},
            {"role": "user", "content": f"question {turn} of conversation {conversation}"},
        ],
        "max_tokens": 4,
    }
    headers = {TEST_ID: f"c{conversation}-t{turn}"}
    async with gateway.client.post(
        gateway.url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.status == 200, await response.text()
        answer: dict[str, Any] = await response.json()
        return answer


def decision_of(gateway: PolicydGateway, test_id: str) -> Any:
    (found,) = [
        s for s in gateway.telemetry.spans.values() if s.request.headers.get(TEST_ID) == test_id
    ]
    return found.decision


async def test_every_later_turn_goes_to_the_pod_holding_the_conversation(
    gateway: PolicydGateway,
) -> None:
    first_pods: dict[int, str] = {}
    for conversation in range(6):
        await ask(gateway, conversation, 0)
        first = decision_of(gateway, f"c{conversation}-t0")
        first_pods[conversation] = first.pod
        assert first.best_prefix_match == 0.0  # nothing of it is cached anywhere yet
    index = gateway.service.prefix.locator.index
    if isinstance(index, PreciseIndex):  # the pods' events arrive on their own
        addresses = {pod.name: pod.address for pod in gateway.service.pool.snapshot().pods}
        await until(
            lambda: all(index.blocks(addresses[pod]) > 0 for pod in first_pods.values()),
            "the pods' KV events",
        )
    for turn in (1, 2):
        for conversation in range(6):
            answer = await ask(gateway, conversation, turn)
            decision = decision_of(gateway, f"c{conversation}-t{turn}")
            assert decision.pod == first_pods[conversation]
            assert decision.prefix_match == decision.best_prefix_match
            assert decision.prefix_match > 0.8  # the system prompt is most of the prompt
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached > 0.8 * answer["usage"]["prompt_tokens"]
