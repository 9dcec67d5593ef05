"""Real HTTP through the real Envoy, with policyd deciding over real gRPC.

The router is a scripted test double (see ``e2e_support``); what these tests
prove is the wire path: which pod Envoy reaches, what it receives, what the
client gets back, and what policyd records on the way.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from e2e_rig import Gateway, settled
from e2e_support import JSON_USAGE, SSE_USAGE, ScriptedRouter, Snapshot, sse_events
from multidict import CIMultiDict

from policyd.extproc.replies import DESTINATION_HEADER
from policyd.policy.decision import Decision, Outcome
from policyd.policy.request import Request
from policyd.pool.pod import Pod

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


async def post(
    gateway: Gateway,
    body: Any,
    headers: dict[str, str] | None = None,
    path: str = COMPLETIONS,
) -> tuple[int, CIMultiDict[str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with gateway.client.post(
        gateway.url + path,
        data=data,
        headers={"content-type": "application/json", **(headers or {})},
    ) as response:
        return response.status, CIMultiDict(response.headers), await response.read()


def served_by(headers: CIMultiDict[str]) -> str:
    return headers.get("x-test-upstream", "")


def total_received(gateway: Gateway) -> int:
    return sum(len(u.received) for u in gateway.upstreams.values())


def in_flight(gateway: Gateway) -> dict[str, int]:
    return {name: pod.in_flight for name, pod in gateway.pods.items()}


async def test_each_request_reaches_the_pod_the_router_picks(gateway: Gateway) -> None:
    for pick in ("pod-b", "pod-a", "pod-b"):
        status, headers, body = await post(
            gateway, {"model": "m", "prompt": "hi"}, {"x-test-pick": pick}
        )
        assert status == 200, body
        assert served_by(headers) == pick
        received = gateway.upstreams[pick].received[-1]
        assert received.headers[DESTINATION_HEADER] == gateway.upstreams[pick].address
    assert in_flight(gateway) == {"pod-a": 0, "pod-b": 0}


async def test_the_router_sees_the_request_as_parsed_from_headers_and_body(
    gateway: Gateway,
) -> None:
    body = {
        "model": "chat-model",
        "messages": [{"role": "user", "content": "x" * 40}],
        "max_completion_tokens": 64,
    }
    status, _, _ = await post(
        gateway, body, {"x-gateway-inference-criticality": "Sheddable", "x-tenant": "t1"}, CHAT
    )
    assert status == 200
    seen = gateway.router.seen[-1]
    assert (seen.model, seen.path) == ("chat-model", CHAT)
    assert seen.headers["x-gateway-inference-criticality"] == "Sheddable"  # the policy's to read
    assert (seen.prompt_tokens, seen.max_tokens, seen.stream) == (4 + 10, 64, False)
    assert seen.headers["x-tenant"] == "t1"
    assert seen.id and seen.id == seen.headers["x-request-id"]  # Envoy's request id


async def test_a_client_supplied_destination_is_ignored(gateway: Gateway) -> None:
    pod_a = gateway.upstreams["pod-a"].address
    admin = f"127.0.0.1:{gateway.envoy.admin_port}"
    for spoofed in (pod_a, admin, f"{pod_a},{admin}"):
        status, headers, _ = await post(
            gateway,
            {"model": "m", "prompt": "hi"},
            {"x-test-pick": "pod-b", DESTINATION_HEADER: spoofed},
        )
        assert status == 200
        assert served_by(headers) == "pod-b"
        received = gateway.upstreams["pod-b"].received[-1]
        assert received.headers[DESTINATION_HEADER] == gateway.upstreams["pod-b"].address
        # The router never saw the spoofed value either.
        assert DESTINATION_HEADER not in gateway.router.seen[-1].headers


async def test_json_usage_and_timings_are_recorded_against_the_decision(gateway: Gateway) -> None:
    status, _, _ = await post(gateway, {"model": "m", "prompt": "hi"}, {"x-test-pick": "pod-a"})
    assert status == 200
    await settled(gateway.server)
    span = gateway.telemetry.spans[gateway.router.seen[-1].id]
    assert span.decision.pod == "pod-a"
    assert span.status == 200
    assert span.end_calls == 1
    assert span.ended["completed"] is True
    assert (span.ended["prompt_tokens"], span.ended["completion_tokens"]) == (
        JSON_USAGE["prompt_tokens"],
        JSON_USAGE["completion_tokens"],
    )
    assert 0 <= span.seconds_to_headers <= span.ended["duration_seconds"]  # type: ignore[operator]
    # The trace header telemetry asked for reached the model server.
    received = gateway.upstreams["pod-a"].received[-1]
    assert received.headers["traceparent"] == span.upstream_headers["traceparent"]


async def test_a_stream_passes_through_byte_identical_and_live_with_usage_recorded(
    gateway: Gateway,
) -> None:
    upstream = gateway.upstreams["pod-b"]
    upstream.release_stream.clear()
    body = {"model": "m", "prompt": "hi", "stream": True}
    async with gateway.client.post(
        gateway.url + COMPLETIONS, json=body, headers={"x-test-pick": "pod-b"}
    ) as response:
        assert response.status == 200
        assert response.headers["content-type"] == "text/event-stream"
        expected = sse_events("m")
        # The first event arrives while the upstream still holds the rest back:
        # nothing between the pod and the client buffers the stream.
        first = await asyncio.wait_for(response.content.readexactly(len(expected[0])), 30)
        assert first == expected[0]
        assert gateway.pods["pod-b"].in_flight == 1
        upstream.release_stream.set()
        rest = await response.content.read()
    assert first + rest == b"".join(expected)
    assert gateway.pods["pod-b"].in_flight == 0  # at once; the span is settled just after
    await settled(gateway.server)
    span = gateway.telemetry.spans[gateway.router.seen[-1].id]
    assert span.ended["completed"] is True
    assert span.ended["prompt_tokens"] == SSE_USAGE["prompt_tokens"]
    assert span.ended["completion_tokens"] == SSE_USAGE["completion_tokens"]
    assert span.ended["first_body_seconds"] is not None
    assert gateway.pods["pod-b"].in_flight == 0


async def test_a_get_without_a_body_reaches_the_least_busy_pod(gateway: Gateway) -> None:
    busy = gateway.pods["pod-a"]
    busy.load.count = 1
    try:
        async with gateway.client.get(
            gateway.url + "/v1/models", headers={DESTINATION_HEADER: "6.6.6.6:80"}
        ) as response:
            status, headers, body = (
                response.status,
                CIMultiDict(response.headers),
                await response.read(),
            )
    finally:
        busy.load.count = 0
    assert status == 200, body
    assert served_by(headers) == "pod-b"
    received = gateway.upstreams["pod-b"].received[-1]
    assert (received.path, received.body) == ("/v1/models", b"")
    assert received.headers[DESTINATION_HEADER] == gateway.upstreams["pod-b"].address
    assert in_flight(gateway) == {"pod-a": 0, "pod-b": 0}


async def test_a_post_without_a_body_is_a_400_and_reaches_no_pod(gateway: Gateway) -> None:
    before = total_received(gateway)
    status, headers, body = await post(gateway, b"")
    assert (status, headers["content-type"]) == (400, "application/json")
    assert json.loads(body)["error"]["code"] == "missing_body"
    assert total_received(gateway) == before


@pytest.mark.parametrize(
    ("headers", "body", "status", "code"),
    [
        ({}, b"{not json", 400, "invalid_json"),
        ({}, b"[1, 2]", 400, "invalid_json"),
        ({}, {"prompt": "no model"}, 400, "missing_model"),
        ({}, {"model": "m", "prompt": "p", "max_tokens": "ten"}, 400, "invalid_max_tokens"),
        ({}, {"model": "m", "prompt": {"not": "a prompt"}}, 400, "invalid_prompt"),
        ({"x-test-outcome": "unknown-model"}, {"model": "m", "prompt": "p"}, 404, None),
        ({"x-test-outcome": "shed"}, {"model": "m", "prompt": "p"}, 429, "request_shed"),
        ({"x-test-outcome": "no-capacity"}, {"model": "m", "prompt": "p"}, 503, None),
        ({"x-test-outcome": "raise"}, {"model": "m", "prompt": "p"}, 500, "policy_error"),
    ],
)
async def test_errors_come_back_as_json_with_the_right_status(
    gateway: Gateway, headers: dict[str, str], body: Any, status: int, code: str | None
) -> None:
    before = total_received(gateway)
    got_status, got_headers, got_body = await post(gateway, body, headers)
    assert got_status == status
    assert got_headers["content-type"] == "application/json"
    error = json.loads(got_body)["error"]
    assert error["message"]
    assert error["type"]
    if code is not None:
        assert error["code"] == code
    assert total_received(gateway) == before  # no pod saw it


async def test_no_ready_pods_is_a_503(gateway: Gateway) -> None:
    full = gateway.pool.snapshot
    gateway.pool.snapshot = Snapshot(())
    try:
        status, _, body = await post(gateway, {"model": "m", "prompt": "p"})
    finally:
        gateway.pool.snapshot = full
    assert status == 503
    assert json.loads(body)["error"]["code"] == "no_ready_endpoints"


async def test_a_router_bug_fails_only_its_own_request(gateway: Gateway) -> None:
    ok = {"model": "m", "prompt": "p"}
    results = await asyncio.gather(
        *(post(gateway, ok, {"x-test-outcome": "raise"} if i % 3 == 0 else {}) for i in range(12))
    )
    statuses = [status for status, _, _ in results]
    assert statuses == [500 if i % 3 == 0 else 200 for i in range(12)]
    status, _, _ = await post(gateway, ok)
    assert status == 200
    assert in_flight(gateway) == {"pod-a": 0, "pod-b": 0}


async def test_a_model_rewrite_reaches_the_pod_with_a_correct_body(gateway: Gateway) -> None:
    body = {"model": "base", "prompt": "héllo", "max_tokens": 5}
    status, _, response = await post(
        gateway, body, {"x-test-pick": "pod-a", "x-test-target-model": "base-lora-v2"}
    )
    assert status == 200, response
    assert json.loads(response)["model"] == "base-lora-v2"
    received = gateway.upstreams["pod-a"].received[-1]
    assert json.loads(received.body) == {**body, "model": "base-lora-v2"}
    assert int(received.headers["Content-Length"]) == len(received.body)


async def test_a_one_mib_prompt_gets_through(gateway: Gateway) -> None:
    prompt = "y" * (1024 * 1024)
    status, _, response = await post(
        gateway, {"model": "m", "prompt": prompt}, {"x-test-pick": "pod-b"}
    )
    assert status == 200, response[:200]
    assert gateway.router.seen[-1].prompt_tokens == 1024 * 1024 // 4
    received = gateway.upstreams["pod-b"].received[-1]
    assert json.loads(received.body)["prompt"] == prompt


async def test_a_body_past_the_buffer_limit_is_refused_by_envoy(gateway: Gateway) -> None:
    before = len(gateway.router.seen)
    status, _, _ = await post(gateway, {"model": "m", "prompt": "z" * (5 * 1024 * 1024)})
    assert status == 413
    assert len(gateway.router.seen) == before


async def test_a_new_router_takes_over_from_the_next_request(gateway: Gateway) -> None:
    class AlwaysPodA:
        def decide(self, request: Request, candidates: Any, prompt: Any = None) -> Decision:
            pod: Pod = next(p for p in candidates if p.name == "pod-a")
            return Decision(Outcome.ROUTED, "a-only", "2", request.model, pod.address, pod.name)

    original = gateway.router
    routers: list[Any] = [AlwaysPodA()]
    gateway.server.processor.routers = lambda: routers[0]
    try:
        _, headers, _ = await post(gateway, {"model": "m", "prompt": "p"}, {"x-test-pick": "pod-b"})
        assert served_by(headers) == "pod-a"
        routers[0] = original
        _, headers, _ = await post(gateway, {"model": "m", "prompt": "p"}, {"x-test-pick": "pod-b"})
        assert served_by(headers) == "pod-b"
    finally:
        gateway.server.processor.routers = lambda: original
    assert isinstance(original, ScriptedRouter)
