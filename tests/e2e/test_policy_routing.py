"""The whole product: real HTTP through the real Envoy to policyd's real policy engine
and pool, routing over simulated vLLM pods.

The policy set is ``rules/default.yaml`` (the seed LoRA-affinity tree) limited
to the simulated models, plus two small policies picked by a header: a batch
tier that is paused (a shed node: 429) and a standby tier whose only pod never
answers its metrics (no ready pod: 503). Which pod served a request is read
from the pods themselves (each simulated pod counts the requests it finished)
and compared with the decision policyd recorded.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from e2e_rig import (
    PolicydGateway,
    service_candidates,
    settled,
    start_policyd_gateway,
    stop_policyd_gateway,
    until,
)
from e2e_support import RecordedSpan, free_port

from policyd.demo.stack import warm_up
from policyd.extproc.replies import DESTINATION_HEADER
from policyd.sim import L4_LLAMA2_7B, adapter_names

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

REPO = Path(__file__).resolve().parents[2]
MODELS = [L4_LLAMA2_7B.base_model, *adapter_names(12)]
CRITICAL = {"x-gateway-inference-criticality": "critical"}
TEST_ID = "x-test-id"


def policy_set(directory: Path) -> Path:
    models = json.dumps(MODELS)
    seed = (REPO / "rules" / "default.yaml").read_text()
    assert 'models: ["*"]' in seed
    (directory / "default.yaml").write_text(seed.replace('models: ["*"]', f"models: {models}"))
    (directory / "batch.yaml").write_text(
        f"name: batch\nmatch:\n  models: {models}\n  headers: {{x-tier: batch}}\n"
        "filters:\n  paused:\n    shed: batch traffic is paused\n"
    )
    (directory / "standby.yaml").write_text(
        f"name: standby\nmatch:\n  models: {models}\n  headers: {{x-tier: standby}}\n"
        "pool:\n  labels: {role: standby}\n"
    )
    return directory


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PolicydGateway]:
    tmp = tmp_path_factory.mktemp("policyd")
    policies = policy_set(tmp_path_factory.mktemp("policies"))
    standby = (
        f"  - {{name: standby-0, address: '127.0.0.1:{free_port()}', labels: {{role: standby}}}}\n"
    )
    rig = await start_policyd_gateway(tmp, policies, extra_pods=standby)
    try:
        yield rig
    finally:
        await stop_policyd_gateway(rig)


async def post(
    gateway: PolicydGateway,
    body: Any,
    headers: dict[str, str] | None = None,
    path: str = "/v1/completions",
) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with gateway.client.post(
        gateway.url + path,
        data=data,
        headers={"content-type": "application/json", **(headers or {})},
    ) as response:
        assert response.headers["content-type"].startswith("application/json")
        return response.status, await response.json()


def span(gateway: PolicydGateway, test_id: str) -> RecordedSpan:
    """The decision policyd recorded for the request sent with ``x-test-id: test_id``."""
    found = [
        s for s in gateway.telemetry.spans.values() if s.request.headers.get(TEST_ID) == test_id
    ]
    assert len(found) == 1, f"{len(found)} decisions for {test_id}"
    return found[0]


def nodes(recorded: RecordedSpan) -> list[str]:
    return [step.node for step in recorded.decision.trace]


def completion(model: str, max_tokens: int = 4, **more: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": "Write a haiku about routing",
        "max_tokens": max_tokens,
        **more,
    }


async def idle(gateway: PolicydGateway) -> None:
    await until(
        lambda: all(
            p.running == 0 and p.waiting_queue == 0 for p in service_candidates(gateway.service)
        ),
        "the pods to be idle",
    )


async def test_each_request_reaches_the_pod_the_policy_picked(gateway: PolicydGateway) -> None:
    for index, model in enumerate(["adapter-3", "adapter-7", MODELS[0], "adapter-3", "adapter-11"]):
        before = gateway.served()
        status, body = await post(gateway, completion(model), {TEST_ID: f"pick-{index}"})
        assert status == 200, body
        assert body["model"] == model
        await settled(gateway.service.server)
        recorded = span(gateway, f"pick-{index}")
        assert recorded.decision.policy == "default"
        after = gateway.served()
        grew = {pod for pod in after if after[pod] != before[pod]}
        assert grew == {recorded.decision.pod}
        assert after[recorded.decision.pod] == before[recorded.decision.pod] + 1
        assert recorded.ended["completion_tokens"] == body["usage"]["completion_tokens"]


async def test_requests_for_one_adapter_concentrate_on_the_pods_running_it(
    gateway: PolicydGateway,
) -> None:
    """The seed tree's "lora affinity" node, for critical requests, over a burst."""
    await idle(gateway)
    adapters = ["adapter-0", "adapter-1", "adapter-2"]
    before = gateway.served()
    # One long request per adapter starts each adapter somewhere ...
    first = [
        asyncio.create_task(post(gateway, completion(a, 60), {**CRITICAL, TEST_ID: f"lead-{a}"}))
        for a in adapters
    ]

    def running_somewhere() -> bool:
        pods = service_candidates(gateway.service)
        return all(any(a in p.active_loras for p in pods) for a in adapters)

    await until(running_somewhere, "policyd to scrape the adapters as running")
    homes = {
        a: {p.name for p in service_candidates(gateway.service) if a in p.active_loras}
        for a in adapters
    }
    # ... and the burst that follows goes where its adapter runs.
    burst = [(a, i) for i in range(6) for a in adapters]
    answers = await asyncio.gather(
        *(
            post(gateway, completion(a, 4), {**CRITICAL, TEST_ID: f"burst-{a}-{i}"})
            for a, i in burst
        )
    )
    assert [status for status, _ in answers] == [200] * len(burst)
    leads = await asyncio.gather(*first)
    assert [status for status, _ in leads] == [200] * len(adapters)

    chosen: dict[str, Counter[str]] = {a: Counter() for a in adapters}
    for a, i in burst:
        recorded = span(gateway, f"burst-{a}-{i}")
        assert "lora affinity" in nodes(recorded)
        chosen[a][recorded.decision.pod] += 1
    for a in adapters:
        assert set(chosen[a]) <= homes[a], (a, chosen[a], homes[a])
    # Random routing would spread 6 requests over about 4 of the 6 pods.
    assert sum(len(pods) for pods in chosen.values()) / len(adapters) <= 2
    # The pods themselves saw exactly the requests policyd sent them.
    decided = Counter(span(gateway, f"lead-{a}").decision.pod for a in adapters)
    for counts in chosen.values():
        decided.update(counts)
    after = gateway.served()
    assert {pod: after[pod] - before[pod] for pod in after if after[pod] != before[pod]} == dict(
        decided
    )


async def test_a_client_supplied_destination_is_ignored(gateway: PolicydGateway) -> None:
    admin = f"127.0.0.1:{gateway.envoy.admin_port}"
    nobody = f"127.0.0.1:{free_port()}"
    for index, spoofed in enumerate((admin, nobody, f"{nobody},{admin}")):
        before = gateway.served()
        status, body = await post(
            gateway,
            completion("adapter-5"),
            {DESTINATION_HEADER: spoofed, TEST_ID: f"spoof-{index}"},
        )
        assert status == 200, body
        assert body["object"] == "text_completion"
        recorded = span(gateway, f"spoof-{index}")
        assert DESTINATION_HEADER not in recorded.request.headers
        after = gateway.served()
        assert after[recorded.decision.pod] == before[recorded.decision.pod] + 1


async def test_an_openai_client_can_list_the_models_through_the_gateway(
    gateway: PolicydGateway,
) -> None:
    async with gateway.client.get(gateway.url + "/v1/models", headers={TEST_ID: "models"}) as got:
        status, listing = got.status, await got.json()
    assert status == 200, listing
    assert listing["object"] == "list"
    assert listing["data"][0]["id"] == L4_LLAMA2_7B.base_model
    recorded = span(gateway, "models")
    assert (recorded.decision.policy, recorded.decision.pod.startswith("vllm-")) == ("", True)
    assert recorded.request.model == ""


async def test_a_stream_passes_through_intact_with_its_usage_recorded(
    gateway: PolicydGateway,
) -> None:
    body = completion("adapter-4", 24, stream=True, stream_options={"include_usage": True})
    async with gateway.client.post(
        gateway.url + "/v1/completions", json=body, headers={TEST_ID: "stream"}
    ) as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = await response.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    assert events[-2] == b"data: [DONE]"
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in events[:-2]]
    tokens = [c for c in chunks if c["choices"]]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert len(tokens) == usage["completion_tokens"] > 0
    assert tokens[-1]["choices"][0]["finish_reason"] in {"stop", "length"}
    await settled(gateway.service.server)
    recorded = span(gateway, "stream")
    assert recorded.status == 200
    assert recorded.ended["completed"] is True
    assert recorded.ended["completion_tokens"] == usage["completion_tokens"]
    assert recorded.ended["prompt_tokens"] == usage["prompt_tokens"]
    assert 0 < recorded.ended["first_body_seconds"] <= recorded.ended["duration_seconds"]


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b'{"model": "adapter-1", "prompt": ', {}, 400, "invalid_json"),
        (completion("gpt-4o"), {}, 404, "model_not_found"),
        (completion("adapter-1"), {"x-tier": "batch"}, 429, "request_shed"),
        (completion("adapter-1"), {"x-tier": "standby"}, 503, "no_ready_endpoints"),
    ],
)
async def test_errors_come_back_as_json_and_reach_no_pod(
    gateway: PolicydGateway, body: Any, headers: dict[str, str], status: int, code: str
) -> None:
    before = gateway.served()
    got, answer = await post(gateway, body, headers)
    assert got == status
    assert answer["error"]["code"] == code
    assert answer["error"]["message"]
    await asyncio.sleep(0.05)
    assert gateway.served() == before


async def test_a_pod_that_goes_away_stops_receiving_traffic(gateway: PolicydGateway) -> None:
    gone = gateway.server("vllm-5")
    await gone.go_away()
    try:
        await until(
            lambda: "vllm-5" not in {p.name for p in service_candidates(gateway.service)},
            "the pool to drop the pod",
            timeout=2,
        )
        answers = await asyncio.gather(
            *(
                post(gateway, completion(MODELS[i % len(MODELS)]), {TEST_ID: f"after-{i}"})
                for i in range(18)
            )
        )
        assert [status for status, _ in answers] == [200] * 18
        assert all(span(gateway, f"after-{i}").decision.pod != "vllm-5" for i in range(18))
    finally:
        await gone.come_back()
        await warm_up([gone])
    await until(
        lambda: any(
            p.name == "vllm-5" and p.max_loras for p in service_candidates(gateway.service)
        ),
        "the pod to return",
    )
