"""SLO-aware routing through the real Envoy: policyd learns each simulated pod's latency
from the answers it routes, a policy reading ``pod.predicted_ttft_ms`` routes on it,
and the span of each decision carries the chosen pod's prediction, the client's
objective and, at the end, what the answer took."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from e2e_rig import PolicydGateway, settled, start_policyd_gateway, stop_policyd_gateway

from policyd.latency.model import WARM

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

REPO = Path(__file__).resolve().parents[2]
TEST_ID = "x-test-id"


def documented_example() -> str:
    """The worked example of docs/policy-language.md, as an operator would copy it."""
    text = (REPO / "docs" / "policy-language.md").read_text()
    start = text.index("name: slo-example")
    return text[start : text.index("```", start)]


@pytest_asyncio.fixture(loop_scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PolicydGateway]:
    tmp = tmp_path_factory.mktemp("slo")
    (tmp / "slo.yaml").write_text(documented_example())
    rig = await start_policyd_gateway(tmp, tmp / "slo.yaml", pods=2, time_scale=20.0)
    try:
        yield rig
    finally:
        await stop_policyd_gateway(rig)


async def ask(gateway: PolicydGateway, test_id: str) -> None:
    body = {
        "model": "meta-llama/Llama-2-7b-hf",
        "messages": [{"role": "user", "content": f"tell me about {test_id}"}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {TEST_ID: test_id, "x-llm-d-slo-ttft-ms": "5000"}
    async with gateway.client.post(
        gateway.url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.status == 200, await response.text()
        text = await response.text()
        assert text.rstrip().endswith("data: [DONE]")


def span_of(gateway: PolicydGateway, test_id: str) -> Any:
    (found,) = [
        s for s in gateway.telemetry.spans.values() if s.request.headers.get(TEST_ID) == test_id
    ]
    return found


async def test_the_models_learn_and_the_span_carries_prediction_and_outcome(
    gateway: PolicydGateway,
) -> None:
    # Four at a time: the light-load score spreads them, so both pods learn.
    for batch in range(12):
        await asyncio.gather(*(ask(gateway, f"warm-{batch}-{i}") for i in range(4)))
    await settled(gateway.service.server)
    fits = gateway.service.latency.fits
    assert any(f.ttft.samples >= WARM and f.tpot.samples >= WARM for f in fits.values())

    await ask(gateway, "measured")
    await settled(gateway.service.server)
    span = span_of(gateway, "measured")
    decision = span.decision
    assert span.request.slo_ttft_ms == 5000.0
    assert decision.predicted is not None
    predicted_ttft, predicted_tpot = decision.predicted
    assert fits[decision.pod].ttft.samples >= WARM  # the quickest warm pod won
    assert predicted_ttft > 0.0 and predicted_tpot > 0.0
    ended = span.ended
    assert ended["completed"] and ended["completion_tokens"] == 8
    assert ended["first_body_seconds"] is not None
    # The span's end has what the prediction is checked against: the actual TTFT.
    assert ended["first_body_seconds"] * 1000.0 < 5000.0
