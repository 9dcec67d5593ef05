"""Test doubles for the end-to-end path, named for what they stand in for.

- :class:`TestUpstream`: a *test upstream*, a small real HTTP server on
  loopback answering OpenAI-shaped JSON and SSE (OpenAI responses and
  embeddings and Anthropic messages in their own shapes), which records every request
  it receives (headers and body, as Envoy forwarded them) and says who served
  it. The wire-path tests (``e2e_rig.start_gateway``) use it as the model
  server for that record, which the simulated vLLM pods (``policyd.sim``,
  used by ``start_policyd_gateway``) do not keep; it is a real HTTP peer for
  Envoy.
- :class:`ScriptedRouter`: a test double of ``policy.Router`` with the same
  ``decide(request, candidates) -> Decision`` contract. The request's
  ``x-test-*`` headers script its decision, so one long-lived server can
  answer every test's case deterministically; what the e2e tests prove is the
  wire path through the real Envoy, not policy logic.
- :class:`SwappablePool`: the datastore's published snapshot, swappable.
- :class:`RecordingTelemetry`: records what the serving path reports.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from policyd.policy.decision import Decision, Outcome
from policyd.policy.request import Request
from policyd.pool.pod import Pod
from policyd.telemetry.exchange_end import ExchangeEnd


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# -- test upstream (model-server stand-in) ------------------------------------------


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


SSE_USAGE = {"prompt_tokens": 11, "completion_tokens": 3}
JSON_USAGE = {"prompt_tokens": 5, "completion_tokens": 2}


def sse_events(model: str) -> list[bytes]:
    """The exact event-stream bytes a streaming test upstream sends, chunk by chunk."""
    chunks = [
        {"id": "cmpl-1", "object": "text_completion", "model": model, "choices": [{"text": t}]}
        for t in ("Hel", "lo", "!")
    ]
    final = {"id": "cmpl-1", "model": model, "choices": [], "usage": SSE_USAGE}
    events = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks]
    events.append(f"data: {json.dumps(final)}\n\n".encode())
    events.append(b"data: [DONE]\n\n")
    return events


# What a test upstream answers on the other APIs' paths, in each API's own usage shape.
RESPONSES_USAGE = {"input_tokens": 13, "output_tokens": 6, "total_tokens": 19}
EMBEDDINGS_USAGE = {"prompt_tokens": 4, "total_tokens": 4}
MESSAGES_INPUT_TOKENS, MESSAGES_OUTPUT_TOKENS = 17, 8


def api_answer(path: str, model: str, stream: bool) -> tuple[str, list[bytes]] | None:
    """The content type and body chunks a test upstream answers an OpenAI responses,
    embeddings or Anthropic messages request with; None for other paths."""
    if path.endswith("/responses"):
        done = {
            "id": "resp_1",
            "object": "response",
            "model": model,
            "output": [],
            "usage": RESPONSES_USAGE,
        }
        if not stream:
            return "application/json", [json.dumps(done).encode()]
        events = [
            ("response.created", {"type": "response.created", "response": {**done, "usage": None}}),
            ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "ok"}),
            ("response.completed", {"type": "response.completed", "response": done}),
        ]
    elif path.endswith("/embeddings"):
        answer = {
            "object": "list",
            "data": [{"object": "embedding", "embedding": [0.0]}],
            "model": model,
            "usage": EMBEDDINGS_USAGE,
        }
        return "application/json", [json.dumps(answer).encode()]
    elif path.endswith("/messages"):
        usage = {"input_tokens": MESSAGES_INPUT_TOKENS, "output_tokens": MESSAGES_OUTPUT_TOKENS}
        message = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": "ok"}],
            "usage": usage,
        }
        if not stream:
            return "application/json", [json.dumps(message).encode()]
        start = {**message, "content": [], "usage": {**usage, "output_tokens": 1}}
        events = [
            ("message_start", {"type": "message_start", "message": start}),
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "ok"},
                },
            ),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn"},
                    "usage": {"output_tokens": MESSAGES_OUTPUT_TOKENS},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
    else:
        return None
    return "text/event-stream", [
        f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events
    ]


class TestUpstream:
    """A test upstream HTTP server on loopback (stands in for a model server)."""

    __test__ = False  # not a pytest test class

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = 0
        self.received: list[Received] = []
        # A streaming answer sends its first event, then waits for this before the rest,
        # so a test can prove the first event reached the client while the stream was open.
        self.release_stream = asyncio.Event()
        # An answer's headers wait for this (set unless a test clears it), so a test can
        # look at the pool while a request is at the pod and not yet answered.
        self.release_headers = asyncio.Event()
        self.release_headers.set()
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listening.bind(("127.0.0.1", 0))
        self.port = listening.getsockname()[1]
        await web.SockSite(self._runner, listening).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(Received(request.path, dict(request.headers), body))
        await asyncio.wait_for(self.release_headers.wait(), timeout=10)
        document = json.loads(body) if body else {}
        served = {"x-test-upstream": self.name}
        other_api = api_answer(
            request.path, document.get("model", ""), bool(document.get("stream"))
        )
        if other_api is not None:
            content_type, chunks = other_api
            response = web.StreamResponse(headers={**served, "content-type": content_type})
            await response.prepare(request)
            for chunk in chunks:
                await response.write(chunk)
            await response.write_eof()
            return response
        if document.get("stream"):
            response = web.StreamResponse(headers={**served, "content-type": "text/event-stream"})
            await response.prepare(request)
            events = sse_events(document.get("model", ""))
            await response.write(events[0])
            await asyncio.wait_for(self.release_stream.wait(), timeout=10)
            for event in events[1:]:
                await response.write(event)
            await response.write_eof()
            return response
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": document.get("model"),
                "served_by": self.name,
                "choices": [{"text": "ok"}],
                "usage": JSON_USAGE,
            },
            headers=served,
        )


# -- policy / pool / telemetry doubles ----------------------------------------------


class ScriptedRouter:
    """A test double of ``policy.Router``, scripted by the request's headers.

    ``x-test-pick: <pod name>`` picks that pod (default: the first candidate);
    ``x-test-outcome: shed | no-capacity | unknown-model | raise`` forces an
    outcome (``raise`` simulates a bug in the router);
    ``x-test-target-model: <name>`` rewrites the model.
    With no candidates the answer is NO_CAPACITY, as the real router's is.
    """

    def __init__(self) -> None:
        self.seen: list[Request] = []

    def decide(self, request: Request, candidates: Sequence[Pod], prompt: Any = None) -> Decision:
        self.seen.append(request)
        headers = request.headers
        outcome = headers.get("x-test-outcome", "")
        target = headers.get("x-test-target-model", request.model)
        if outcome == "raise":
            raise RuntimeError("scripted router bug")
        if outcome:
            return Decision(Outcome(outcome), "test", "1", target, reason=f"scripted {outcome}")
        if not candidates:
            return Decision(Outcome.NO_CAPACITY, "test", "1", target, reason="no pods")
        wanted = headers.get("x-test-pick")
        chosen = next((p for p in candidates if p.name == wanted), candidates[0])
        return Decision(
            Outcome.ROUTED,
            "test",
            "1",
            target,
            endpoint=chosen.address,
            pod=chosen.name,
            fallbacks=tuple(p.address for p in candidates if p is not chosen),
        )


@dataclass(frozen=True)
class Snapshot:
    candidates: tuple[Pod, ...]


class SwappablePool:
    """Stands in for the datastore: publishes an immutable snapshot, swappable."""

    def __init__(self, pods: Sequence[Pod]) -> None:
        self.snapshot = Snapshot(tuple(pods))

    def current(self) -> Snapshot:
        return self.snapshot


@dataclass
class RecordedSpan:
    request: Request
    decision: Decision
    carrier: dict[str, str]
    decision_seconds: float
    upstream_headers: Mapping[str, str]
    status: int | None = None
    seconds_to_headers: float | None = None
    ended: dict[str, Any] = field(default_factory=dict)
    end_calls: int = 0
    after_reply_calls: int = 0

    def after_reply(self, shadows: Any = None) -> None:
        self.after_reply_calls += 1

    def response_headers(self, status: int, seconds_to_headers: float) -> None:
        self.status = status
        self.seconds_to_headers = seconds_to_headers

    def end(self, end: ExchangeEnd) -> None:
        self.ended = end._asdict()
        self.end_calls += 1


class RecordingTelemetry:
    """Records every span the serving path opens, by request id."""

    def __init__(self) -> None:
        self.spans: dict[str, RecordedSpan] = {}
        self.stream_errors: list[tuple[str, str]] = []

    def stream_error(self, kind: str, code: str) -> None:
        self.stream_errors.append((kind, code))

    def start(
        self,
        request: Request,
        decision: Decision,
        trace_carrier: Mapping[str, str],
        decision_seconds: float,
    ) -> RecordedSpan:
        trace_id = f"{len(self.spans) + 1:032x}"
        span = RecordedSpan(
            request,
            decision,
            dict(trace_carrier),
            decision_seconds,
            {"traceparent": f"00-{trace_id}-00000000000000aa-01"},
        )
        self.spans[request.id] = span
        return span
