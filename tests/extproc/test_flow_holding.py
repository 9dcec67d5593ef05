"""Flow control on the serving path, over a real gRPC channel: hold, extend, dispatch, answer."""

from __future__ import annotations

import asyncio
import json
import random
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest_asyncio
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from extproc_support import (
    EnvoySide,
    error_of,
    request_body,
    request_headers,
    response_body,
    response_headers,
)

from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.policy import PolicyStore, Router
from policyd.pool.inference_objects import InferenceObjects, combine, rules_of
from policyd.pool.pod import Pod

POLICY = """
name: held
filters:
  all:
    keep: "true"
flow:
  saturated: pod.in_flight >= 1
  bands:
    critical: {max_wait: 30s}
    standard: {max_wait: 30s}
    sheddable: {max_wait: 300ms}
  flows:
    key: request.headers["x-tenant"]
  answer: {status: 429, retry_after: 2s}
"""
BODY = {"model": "m", "prompt": "p"}


@dataclass
class Snapshot:
    candidates: tuple[Pod, ...]
    version: int = 0


@dataclass
class Rig:
    server: ExtProcServer
    envoy: EnvoySide
    pods: tuple[Pod, ...]

    @property
    def held(self) -> int:
        return self.server.processor.holding.control.held

    async def routed(self, headers: dict[str, str] | None = None) -> Any:
        """A request that is routed at once; its stream, left open (the response pending)."""
        call = self.envoy.open()
        await call.write(request_headers(headers))
        await call.read()
        await call.write(request_body(BODY))
        reply = await call.read()
        assert reply.WhichOneof("response") == "request_body", reply
        return call

    async def held_call(self, headers: dict[str, str] | None = None) -> Any:
        """A request that is held: its stream, after Envoy was asked to wait longer."""
        call = self.envoy.open()
        await call.write(request_headers(headers))
        await call.read()
        await call.write(request_body(BODY))
        extension = await call.read()
        assert extension.HasField("override_message_timeout"), extension
        assert extension.WhichOneof("response") is None
        return call


@pytest_asyncio.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    router = Router(PolicyStore.open(path), rng=random.Random(0))
    pods = (Pod(name="p0", address="10.0.0.1:8000"),)
    server = ExtProcServer(
        lambda: router, lambda: Snapshot(pods), options=ServerOptions(port=0, grace_seconds=1)
    )
    port = await server.start()
    envoy = EnvoySide(port)
    try:
        yield Rig(server, envoy, pods)
    finally:
        await envoy.close()
        await server.stop(0.5)


async def test_a_held_request_is_dispatched_when_its_pod_frees(rig: Rig) -> None:
    first = await rig.routed()
    held = await rig.held_call()
    assert rig.held == 1 and rig.pods[0].in_flight == 1
    reading = asyncio.ensure_future(held.read())
    await asyncio.sleep(0.1)
    assert not reading.done()  # no pod has room: still held
    await first.write(response_headers(end_of_stream=True))  # the first request ends
    reply: pb.ProcessingResponse = await asyncio.wait_for(reading, 30)
    assert reply.WhichOneof("response") == "request_body"
    assert rig.held == 0 and rig.pods[0].in_flight == 1  # the held one counts there now
    first.cancel()
    held.cancel()


async def test_the_usage_a_pod_reports_teaches_the_kv_estimate(rig: Rig) -> None:
    """The pod counts 3 prompt tokens where policyd estimated 1 and generates 40 without
    a budget: flow control's estimate of a request follows, once the answer ends."""
    footprint = rig.server.processor.holding.control.flight.footprint
    assert footprint.tokens(100, 0) == 100
    call = await rig.routed()
    await call.write(response_headers())
    await call.read()
    usage = b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":40}}'
    await call.write(response_body(usage, end_of_stream=True))
    await call.read()
    for _ in range(3000):
        if footprint.tokens(100, 0) != 100:
            break
        await asyncio.sleep(0.01)
    assert footprint.tokens(100, 0) == 300 + 20
    call.cancel()


async def test_the_timeout_asked_of_envoy_covers_the_band_wait(rig: Rig) -> None:
    first = await rig.routed()
    call = rig.envoy.open()
    await call.write(request_headers())
    await call.read()
    await call.write(request_body(BODY))
    extension = await call.read()
    assert extension.override_message_timeout.seconds == 31  # 30 s and a second's margin
    first.cancel()
    call.cancel()


async def test_a_client_that_goes_away_leaves_the_queue(rig: Rig) -> None:
    first = await rig.routed()
    held = await rig.held_call()
    assert rig.held == 1
    held.cancel()  # Envoy resets the stream when the client disconnects
    for _ in range(3000):
        if rig.held == 0:
            break
        await asyncio.sleep(0.01)
    assert rig.held == 0
    assert rig.server.processor.body_budget.held == 0
    first.cancel()


async def test_the_max_wait_expires_into_the_configured_answer(rig: Rig) -> None:
    first = await rig.routed()
    held = await rig.held_call({"x-gateway-inference-criticality": "sheddable"})
    reply = await asyncio.wait_for(held.read(), 30)
    status, error = error_of(reply)
    assert (status, error["code"]) == (429, "flow_expired")
    headers = {
        h.header.key: h.header.raw_value for h in reply.immediate_response.headers.set_headers
    }
    assert headers["retry-after"] == b"2"
    assert rig.held == 0
    first.cancel()


async def test_a_flood_from_one_tenant_does_not_stop_another(rig: Rig) -> None:
    """Five of the flood's requests are held before the small tenant's one; the small
    one goes with the first slot that frees (a flow that held nothing goes first)."""
    first = await rig.routed({"x-tenant": "flood"})
    flood = [await rig.held_call({"x-tenant": "flood"}) for _ in range(5)]
    small = await rig.held_call({"x-tenant": "small"})
    small_reply = asyncio.ensure_future(small.read())
    await first.write(response_headers(end_of_stream=True))  # one slot frees
    reply = await asyncio.wait_for(small_reply, 30)
    assert reply.WhichOneof("response") == "request_body"
    assert rig.held == 5
    for call in [first, small, *flood]:
        call.cancel()


async def test_shutdown_answers_what_no_pod_takes_within_the_grace_503(rig: Rig) -> None:
    first = await rig.routed()
    held = await rig.held_call()
    reading = asyncio.ensure_future(held.read())
    await rig.server.stop(0.4)
    reply = await asyncio.wait_for(reading, 30)
    status, error = error_of(reply)
    assert (status, error["code"]) == (503, "flow_shutdown")
    assert await held.read() is grpc.aio.EOF  # the answer ends the stream
    first.cancel()


async def test_a_held_request_keeps_only_its_bytes_and_is_parsed_at_dispatch(rig: Rig) -> None:
    """A chat of many short messages parses into objects many times its size; held
    requests keep only their bytes (what the body budget counts), and each is read
    whole when it is dispatched."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}] * 2000}
    raw = json.dumps(chat).encode()
    first = await rig.routed()
    calls = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(4):
            call = rig.envoy.open()
            await call.write(request_headers(path="/v1/chat/completions"))
            await call.read()
            await call.write(request_body(raw))
            assert (await call.read()).HasField("override_message_timeout")
            calls.append(call)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert rig.held == 4
    assert grown < 2 * 4 * len(raw)  # the parsed chats would be over ten times the bytes
    for call in calls:
        await first.write(response_headers(end_of_stream=True))  # a slot frees: one goes
        reply = await asyncio.wait_for(call.read(), 5)
        assert reply.WhichOneof("response") == "request_body"
        first = call
    assert rig.held == 0
    assert rig.server.processor.body_budget.held == 0
    first.cancel()


async def test_a_held_request_is_dispatched_as_it_was_admitted(tmp_path: Path) -> None:
    """The pool's rewrite and objective are applied once, at admission: objects that
    change while the request is held do not change the model it is sent as."""

    def rewriting_to(target: str) -> InferenceObjects:
        obj = {
            "metadata": {"name": "alias", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {
                "poolRef": {"name": "pool"},
                "rules": [
                    {"matches": [{"model": {"value": "m"}}], "targets": [{"modelRewrite": target}]}
                ],
            },
        }
        rules = rules_of(obj, "pool")
        assert rules is not None
        return combine({}, {"alias": rules})

    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    router = Router(PolicyStore.open(path), rng=random.Random(0))
    pods = (Pod(name="p0", address="10.0.0.1:8000"),)
    objects = [rewriting_to("m-v1")]
    server = ExtProcServer(
        lambda: router,
        lambda: Snapshot(pods),
        options=ServerOptions(port=0, grace_seconds=1),
        objects=lambda: objects[0],
    )
    rig = Rig(server, EnvoySide(await server.start()), pods)
    try:
        first = await rig.routed()
        held = await rig.held_call()
        objects[0] = rewriting_to("m-v2")
        await first.write(response_headers(end_of_stream=True))
        reply: pb.ProcessingResponse = await asyncio.wait_for(held.read(), 30)
        sent = json.loads(reply.request_body.response.body_mutation.body)
        assert sent == {**BODY, "model": "m-v1"}
        first.cancel()
        held.cancel()
    finally:
        await rig.envoy.close()
        await server.stop(0.5)
