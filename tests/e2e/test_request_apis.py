"""OpenAI responses and embeddings and Anthropic messages through the real Envoy.

Each request reaches the pod policyd picked, the router sees what policyd read
from the body, a model rewrite reaches the pod, usage is read from each API's
answer (JSON and streamed), and a malformed body is a JSON 400 after which
policyd keeps serving.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from e2e_rig import Gateway, settled
from e2e_support import (
    EMBEDDINGS_USAGE,
    MESSAGES_INPUT_TOKENS,
    MESSAGES_OUTPUT_TOKENS,
    RESPONSES_USAGE,
)

from policyd.extproc.openai import TOKENS_PER_MESSAGE
from policyd.extproc.replies import DESTINATION_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

RESPONSES_BODY = {
    "model": "gpt",
    "instructions": "be brief",  # 8 characters: 2 tokens
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "x" * 40}]}],
    "max_output_tokens": 64,
}
EMBEDDINGS_BODY = {"model": "emb", "input": ["a" * 8, "b" * 4]}
MESSAGES_BODY = {
    "model": "claude",
    "system": "s" * 12,
    "max_tokens": 256,
    "messages": [{"role": "user", "content": "hello world!"}],
}


async def post(
    gateway: Gateway, path: str, document: Any, pick: str, **headers: str
) -> tuple[int, str, bytes]:
    data = document if isinstance(document, bytes) else json.dumps(document).encode()
    async with gateway.client.post(
        gateway.url + path,
        data=data,
        headers={"content-type": "application/json", "x-test-pick": pick, **headers},
    ) as response:
        return response.status, response.headers.get("x-test-upstream", ""), await response.read()


async def usage_recorded(gateway: Gateway) -> tuple[int | None, int | None]:
    await settled(gateway.server)
    span = gateway.telemetry.spans[gateway.router.seen[-1].id]
    assert span.ended["completed"] is True
    return span.ended["prompt_tokens"], span.ended["completion_tokens"]


def reached(gateway: Gateway, pod: str, path: str) -> dict[str, Any]:
    received = gateway.upstreams[pod].received[-1]
    assert received.path == path
    assert received.headers[DESTINATION_HEADER] == gateway.upstreams[pod].address
    document: dict[str, Any] = json.loads(received.body)
    return document


@pytest.mark.parametrize("stream", [False, True])
async def test_a_responses_request_is_routed_and_its_usage_read(
    gateway: Gateway, stream: bool
) -> None:
    document = {**RESPONSES_BODY, "stream": stream}
    status, served, answer = await post(gateway, "/v1/responses", document, "pod-b")
    assert (status, served) == (200, "pod-b"), answer
    assert reached(gateway, "pod-b", "/v1/responses") == document
    seen = gateway.router.seen[-1]
    assert (seen.model, seen.prompt_tokens, seen.max_tokens, seen.stream) == (
        "gpt",
        2 * TOKENS_PER_MESSAGE + 2 + 10,
        64,
        stream,
    )
    assert await usage_recorded(gateway) == (
        RESPONSES_USAGE["input_tokens"],
        RESPONSES_USAGE["output_tokens"],
    )


async def test_an_embeddings_request_is_routed_and_its_usage_read(gateway: Gateway) -> None:
    status, served, answer = await post(gateway, "/v1/embeddings", EMBEDDINGS_BODY, "pod-a")
    assert (status, served) == (200, "pod-a"), answer
    assert reached(gateway, "pod-a", "/v1/embeddings") == EMBEDDINGS_BODY
    seen = gateway.router.seen[-1]
    assert (seen.model, seen.prompt_tokens, seen.max_tokens, seen.stream) == ("emb", 3, 0, False)
    assert await usage_recorded(gateway) == (EMBEDDINGS_USAGE["prompt_tokens"], 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_anthropic_messages_request_is_routed_rewritten_and_its_usage_read(
    gateway: Gateway, stream: bool
) -> None:
    document = {**MESSAGES_BODY, "stream": stream}
    status, served, answer = await post(
        gateway, "/v1/messages", document, "pod-b", **{"x-test-target-model": "claude-lora"}
    )
    assert (status, served) == (200, "pod-b"), answer
    assert reached(gateway, "pod-b", "/v1/messages") == {**document, "model": "claude-lora"}
    seen = gateway.router.seen[-1]
    assert (seen.model, seen.prompt_tokens, seen.max_tokens, seen.stream) == (
        "claude",
        2 * TOKENS_PER_MESSAGE + 3 + 3,
        256,
        stream,
    )
    assert await usage_recorded(gateway) == (MESSAGES_INPUT_TOKENS, MESSAGES_OUTPUT_TOKENS)


async def test_an_unknown_path_with_a_model_is_routed_by_it(gateway: Gateway) -> None:
    document = {"model": "reranker", "query": "q", "documents": ["a", "b"]}
    status, served, _ = await post(gateway, "/v1/rerank", document, "pod-a")
    assert (status, served) == (200, "pod-a")
    assert reached(gateway, "pod-a", "/v1/rerank") == document
    seen = gateway.router.seen[-1]
    assert (seen.model, seen.prompt_tokens, seen.path) == ("reranker", 0, "/v1/rerank")


@pytest.mark.parametrize(
    ("path", "document", "code"),
    [
        ("/v1/responses", {"model": "gpt", "input": 5}, "invalid_input"),
        (
            "/v1/responses",
            {"model": "gpt", "input": "x", "instructions": 1},
            "invalid_instructions",
        ),
        ("/v1/embeddings", {"model": "emb", "input": [1, "a"]}, "invalid_input"),
        ("/v1/messages", {"model": "claude", "messages": "hi"}, "invalid_messages"),
        ("/v1/messages", {"model": "claude", "system": 3, "messages": []}, "invalid_system"),
        ("/v1/messages", {"model": ["claude"], "messages": []}, "missing_model"),
    ],
)
async def test_a_malformed_body_is_a_json_400_and_policyd_keeps_serving(
    gateway: Gateway, path: str, document: dict[str, Any], code: str
) -> None:
    before = sum(len(u.received) for u in gateway.upstreams.values())
    status, served, answer = await post(gateway, path, document, "pod-a")
    assert (status, served) == (400, "")
    error = json.loads(answer)["error"]
    assert (error["code"], error["type"]) == (code, "invalid_request_error")
    assert error["message"]
    assert sum(len(u.received) for u in gateway.upstreams.values()) == before  # no pod saw it
    valid = {"/v1/responses": RESPONSES_BODY, "/v1/embeddings": EMBEDDINGS_BODY}
    status, served, _ = await post(gateway, path, valid.get(path, MESSAGES_BODY), "pod-b")
    assert (status, served) == (200, "pod-b")
