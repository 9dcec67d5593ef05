"""One simulated vLLM pod behind a real HTTP server (aiohttp) on a local port.

The routes are vLLM's: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health`` and ``GET /metrics``. One more,
``/sim/faults``, lets tests misbehave the pod over HTTP (the same knobs are
methods here): fail every completion request with a chosen status, hang
``/metrics``, or go away (stop listening, drop every connection) for a while.
``POST /reset_prefix_cache`` is vLLM's (development-mode) route.

With ``kv_events_port`` set (0 picks a free port) the pod publishes vLLM's KV
events over ZMQ (``policyd.sim.kv_events``), with a replay socket on
``kv_replay_port`` if that is set too; without, it records none.

Disaggregated prefill/decode (V1 profiles): the completion routes take vLLM's
``kv_transfer_params`` as its NixlConnector does, so llm-d's P/D sidecar works
in front of a pod unchanged. A request with ``do_remote_decode`` is prefilled
and answered with the ``kv_transfer_params`` its decode pod needs; one with
``do_remote_prefill`` waits for its KV and decodes. With ``pd_in_process`` the
pod does the sidecar's part itself: a request naming a prefill pod in
``x-prefiller-host-port`` is first sent there as the sidecar sends it
(``max_tokens`` 1, not streamed, ``do_remote_decode``), then decoded with the
parameters it answers. ``role`` (prefill, decode, both) is what the pod file
tells the router; it does not change what the pod serves.

    server = SimServer(port=0, time_scale=10)
    await server.start()
    ...  # http://127.0.0.1:{server.port}/v1/completions
    await server.stop()
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import aiohttp
from aiohttp import web

from policyd.sim.api import (
    KV_TRANSFER_FIELD,
    ApiError,
    CompletionCall,
    KvTransfer,
    Reply,
    encode,
    error_body,
    parse_call,
    parse_kv_transfer,
)
from policyd.sim.engine import RequestState, SimRequest
from policyd.sim.engine_v1 import new_engine
from policyd.sim.exposition import CONTENT_TYPE, EngineCollector, metrics_registry, render
from policyd.sim.names import ROLES, adapter_names
from policyd.sim.profile import L4_LLAMA2_7B, Profile
from policyd.sim.realtime import RealTimeDriver
from policyd.sim.text import generated_text, token_text

if TYPE_CHECKING:
    from policyd.sim.kv_events import KvEventPublisher

_SHUTDOWN_TIMEOUT_S = 0.25
_CREATED = int(time.time())
PREFILLER_HEADER: Final = "x-prefiller-host-port"  # llm-d's: where the sidecar sends the prefill
_PREFILL_ANSWER_LIMIT: Final = 1 << 20  # a one-token answer is a few kB
TRACE_CONTEXT: Final = ("traceparent", "tracestate")  # W3C trace context, passed to the prefill
# The fields the sidecar caps at one token for the prefill (chat and completions alike).
_TOKEN_LIMIT_FIELDS: Final = ("max_tokens", "max_completion_tokens", "min_tokens")


class _PrefillError(Exception):
    """The prefill pod answered an error: the client gets it as is, as from the sidecar."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


@dataclass(frozen=True, slots=True)
class Faults:
    """The misbehaviour a pod is told to show; the default is none."""

    fail_status: int | None = None
    hang_metrics: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"fail_requests": self.fail_status, "hang_metrics": self.hang_metrics}


class _Progress:
    """Wakes the handler of one request after every step that advanced it."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def on_progress(self, state: RequestState, now: float) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event.clear()


class SimServer:
    """A simulated vLLM pod: engine, real-time driver and HTTP front on ``host:port``."""

    def __init__(
        self,
        profile: Profile = L4_LLAMA2_7B,
        *,
        name: str = "vllm-0",
        host: str = "127.0.0.1",
        port: int = 0,
        adapters: Sequence[str] = adapter_names(12),
        time_scale: float = 1.0,
        seed: int = 0,
        kv_events_port: int | None = None,
        kv_replay_port: int | None = None,
        role: str = "both",
        pd_in_process: bool = False,
    ) -> None:
        if kv_replay_port is not None and kv_events_port is None:
            raise ValueError("a KV-event replay port needs a KV-event port")
        if role not in ROLES:
            raise ValueError(f"unknown pod role {role!r} (one of {', '.join(ROLES)})")
        self.role = role
        self.pd_in_process = pd_in_process
        self.engine_id = f"{name}-{uuid.uuid4().hex[:8]}"  # NixlConnector's engine id
        self._client: aiohttp.ClientSession | None = None
        self.profile = profile
        self.kv_events_port = kv_events_port
        self.kv_replay_port = kv_replay_port
        self.name = name
        self.host = host
        self.port = port
        self.adapters = tuple(adapters)
        self.time_scale = time_scale
        self.seed = seed
        self.faults = Faults()
        self._served = {profile.base_model, *self.adapters}
        self._metrics_released = asyncio.Event()
        self._metrics_released.set()
        self.metrics_held = 0  # /metrics requests a hang_metrics fault holds now (tests wait on it)
        self._runner: web.AppRunner | None = None
        self._driver: RealTimeDriver | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Serialises start, go-away and come-back (a fault timer may race a test).
        self._lifecycle = asyncio.Lock()
        self._next_text_seed = seed * 7919  # one per request the engine takes
        self._registry = metrics_registry(
            EngineCollector(lambda: self.driver.engine, profile.base_model, self._unix_time)
        )

    # -- lifecycle and fault knobs -------------------------------------------------------------

    @property
    def address(self) -> str:
        """``host:port``, as a router names an endpoint."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def driver(self) -> RealTimeDriver:
        if self._driver is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._driver

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        """Listen on ``host:port`` (a free port if 0) with a fresh engine."""
        async with self._lifecycle:
            if self._runner is not None:
                raise RuntimeError(f"{self.name} is already running")
            await self._start()

    @property
    def kv_events_endpoint(self) -> str | None:
        """``tcp://host:port`` of the KV-event PUB socket, or ``None`` when not publishing."""
        return None if self.kv_events_port is None else f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def kv_replay_endpoint(self) -> str | None:
        """``tcp://host:port`` of the KV-event replay (ROUTER) socket, or ``None``."""
        return None if self.kv_replay_port is None else f"tcp://{self.host}:{self.kv_replay_port}"

    async def _kv_publisher(self) -> KvEventPublisher | None:
        if self.kv_events_port is None:
            return None
        from policyd.sim.kv_events import KvEventPublisher  # noqa: PLC0415 (zmq only when asked)

        publisher = await KvEventPublisher.open(
            host=self.host,
            port=self.kv_events_port,
            replay_port=self.kv_replay_port,
            topic=f"kv@{self.address}@{self.profile.base_model}",
            block_size=self.profile.block_size,
            lora_ids={name: i + 1 for i, name in enumerate(self.adapters)},
        )
        self.kv_events_port, self.kv_replay_port = publisher.port, publisher.replay_port
        return publisher

    async def _start(self) -> None:
        driver = RealTimeDriver(new_engine(self.profile, seed=self.seed), self.time_scale)
        runner = web.AppRunner(
            self._application(),
            handler_cancellation=True,
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
            access_log=None,
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
            self.port = runner.addresses[0][1]
            driver.kv_events = await self._kv_publisher()  # its topic names the bound port
        except BaseException:
            await runner.cleanup()
            raise
        driver.start()
        self._driver, self._runner = driver, runner
        if self.pd_in_process and self._client is None:
            self._client = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
            )

    async def stop(self) -> None:
        """Stop for good: go away and cancel pending fault timers."""
        for task in list(self._tasks):
            task.cancel()
        await self.go_away()

    async def go_away(self) -> None:
        """Vanish like a killed pod: stop listening, drop connections and every request."""
        async with self._lifecycle:
            runner, self._runner = self._runner, None
            if runner is not None:
                await runner.cleanup()
            client, self._client = self._client, None
            if client is not None:
                await client.close()
            driver, self._driver = self._driver, None
            if driver is not None:
                await driver.stop()
                if driver.kv_events is not None:
                    await driver.kv_events.close()

    async def come_back(self) -> None:
        """Listen again on the same port, like the pod restarted (fresh engine and metrics)."""
        async with self._lifecycle:
            if self._runner is None:
                await self._start()

    def set_faults(self, *, fail_status: int | None = None, hang_metrics: bool = False) -> None:
        """Replace the current faults; ``set_faults()`` heals the pod."""
        if fail_status is not None and not 400 <= fail_status <= 599:
            raise ValueError(f"a failure status must be 4xx or 5xx, got {fail_status}")
        self.faults = Faults(fail_status, hang_metrics)
        if hang_metrics:
            self._metrics_released.clear()
        else:
            self._metrics_released.set()

    def go_away_for(self, simulated_seconds: float) -> None:
        """Go away now and come back after ``simulated_seconds``."""
        task = asyncio.create_task(self._vanish(simulated_seconds))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _vanish(self, simulated_seconds: float) -> None:
        await self.go_away()
        await asyncio.sleep(simulated_seconds / self.time_scale)
        await self.come_back()

    def _unix_time(self, simulated: float) -> float:
        return self.driver.unix_time(simulated)

    # -- HTTP ------------------------------------------------------------------------------------

    def _application(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_get("/sim/faults", self._get_faults)
        app.router.add_post("/sim/faults", self._post_faults)
        return app

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        driver = self.driver
        progress = _Progress()
        try:
            if self.faults.fail_status is not None:
                raise ApiError(self.faults.fail_status, "simulated failure injected on this pod")
            body = await request.read()
            call = parse_call(
                body, chat=chat, generation_prompt=self.profile.chat_generation_prompt
            )
            prefiller = request.headers.get(PREFILLER_HEADER)
            if self.pd_in_process and prefiller and call.kv_transfer is None:
                transfer = await self._prefill_remotely(prefiller, request, body)
                call = dataclasses.replace(call, kv_transfer=transfer)
            text_seed = self._next_text_seed
            state = driver.submit(self._engine_request(call, progress, text_seed))
        except _PrefillError as failed:
            return web.Response(
                body=failed.body, status=failed.status, content_type="application/json"
            )
        except ApiError as error:
            return _json(error.body(), error.status)
        except ValueError as error:
            return _json(error_body(400, str(error)), 400)
        self._next_text_seed += 1
        reply = Reply(call, state.request.request_id, int(time.time()))
        try:
            if call.stream:
                return await _stream(request, reply, state, progress, text_seed)
            while not state.finished:
                await progress.wait()
            text = generated_text(text_seed, 0, state.generated)
            full = reply.full(
                text,
                state.finish_reason,
                state.generated,
                state.cached_tokens,
                self._handed_over(state),
            )
            return _json(full, 200)
        finally:
            if not state.finished:
                driver.abort(state)

    def _handed_over(self, state: RequestState) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` a prefill for a remote decode answers (NixlConnector's
        shape); ``None`` for any other request. The sim has no NIXL side channel: host and
        port are the pod's HTTP address."""
        if not state.request.remote_decode:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(state.sent_blocks),
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
        }

    async def _prefill_remotely(
        self, prefiller: str, request: web.Request, body: bytes
    ) -> KvTransfer | None:
        """Have ``prefiller`` (``host:port``) prefill the request, as llm-d's sidecar asks
        it; the parameters to decode with, or ``None`` (decode with a local prefill) when
        it answers none. An error answer is the client's (``_PrefillError``), as the
        sidecar forwards it; an unreachable pod is a 502. The request's trace context
        goes along, as the sidecar's instrumented client sends it, so the prefill joins
        the caller's trace."""
        path = request.path
        host, _, port = prefiller.rpartition(":")
        if not host or not port.isdigit():
            raise ApiError(400, f"`{PREFILLER_HEADER}` must be host:port, got {prefiller!r}")
        payload = json.loads(body)  # parse_call has read it already
        payload[KV_TRANSFER_FIELD] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        payload["stream"] = False
        payload.pop("stream_options", None)
        for field in _TOKEN_LIMIT_FIELDS:
            payload[field] = 1
        assert self._client is not None  # made at start when pd_in_process
        try:
            async with self._client.post(
                f"http://{prefiller}{path}",
                data=encode(payload),
                headers={
                    "Content-Type": "application/json",
                    "x-request-id": uuid.uuid4().hex,
                    **{k: v for k in TRACE_CONTEXT if (v := request.headers.get(k)) is not None},
                },
            ) as response:
                answer = await response.content.read(_PREFILL_ANSWER_LIMIT + 1)
                status = response.status
        except (aiohttp.ClientError, OSError) as error:
            raise ApiError(
                502, f"cannot reach the prefill pod {prefiller} ({PREFILLER_HEADER}): {error}"
            ) from None
        if len(answer) > _PREFILL_ANSWER_LIMIT:
            raise ApiError(502, f"the prefill pod {prefiller} answered more than 1 MiB")
        if status >= 400:
            raise _PrefillError(status, answer)
        try:
            params = json.loads(answer).get(KV_TRANSFER_FIELD)
            return None if params is None else parse_kv_transfer(params)
        except (ValueError, AttributeError, ApiError) as error:
            raise ApiError(
                502, f"the prefill pod {prefiller} answered no usable {KV_TRANSFER_FIELD}: {error}"
            ) from None

    def _engine_request(
        self, call: CompletionCall, progress: _Progress, text_seed: int
    ) -> SimRequest:
        if call.model not in self._served:
            raise ApiError(404, f"The model `{call.model}` does not exist.", "model")
        prefix = "chatcmpl" if call.chat else "cmpl"
        return SimRequest(
            f"{prefix}-{uuid.uuid4().hex}",
            call.prompt,
            call.max_tokens,
            adapter=None if call.model == self.profile.base_model else call.model,
            output_length=call.output_tokens,
            listener=progress,
            text_seed=text_seed,
            remote_decode=call.kv_transfer is not None and call.kv_transfer.remote_decode,
            remote_prefill=None if call.kv_transfer is None else call.kv_transfer.remote_prefill,
        )

    async def _models(self, request: web.Request) -> web.Response:
        base = self.profile.base_model
        cards = [_model_card(base, base, None, self.profile.max_model_len)]
        cards += [_model_card(name, f"/adapters/{name}", base, None) for name in self.adapters]
        return _json({"object": "list", "data": cards}, 200)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self._metrics_released.is_set():
            self.metrics_held += 1
            try:
                await self._metrics_released.wait()
            finally:
                self.metrics_held -= 1
        return web.Response(body=render(self._registry), headers={"Content-Type": CONTENT_TYPE})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's route: drop the prefix cache if no block is in use (200 either way)."""
        driver = self.driver
        if driver.engine.reset_prefix_cache():
            driver.publish_kv_events(driver.now())
        return web.Response(status=200)

    async def _get_faults(self, request: web.Request) -> web.Response:
        return _json(self.faults.as_json(), 200)

    async def _post_faults(self, request: web.Request) -> web.StreamResponse:
        """Set faults: ``{"fail_requests": 503|null, "hang_metrics": bool, "go_away_for": s}``."""
        try:
            payload = json.loads(await request.read())
            if not isinstance(payload, dict):
                raise ValueError("the body must be a JSON object")
            unknown = set(payload) - {"fail_requests", "hang_metrics", "go_away_for"}
            if unknown:
                raise ValueError(f"unknown fault knobs: {', '.join(sorted(unknown))}")
            fail = payload.get("fail_requests")
            hang = payload.get("hang_metrics", False)
            away = payload.get("go_away_for")
            if fail is not None and (not isinstance(fail, int) or isinstance(fail, bool)):
                raise ValueError("`fail_requests` must be an HTTP status or null")
            if not isinstance(hang, bool):
                raise ValueError("`hang_metrics` must be a boolean")
            if away is not None and (not isinstance(away, int | float) or away <= 0):
                raise ValueError("`go_away_for` must be a positive number of seconds")
            self.set_faults(fail_status=fail, hang_metrics=hang)
        except ValueError as error:  # json.JSONDecodeError is a ValueError too
            return _json(error_body(400, str(error)), 400)
        response = _json(self.faults.as_json(), 200)
        if away is not None:
            await response.prepare(request)
            await response.write_eof()
            self.go_away_for(float(away))
        return response


async def _stream(
    request: web.Request,
    reply: Reply,
    state: RequestState,
    progress: _Progress,
    text_seed: int,
) -> web.StreamResponse:
    """Server-sent events: one chunk per generated token, usage if asked, then ``[DONE]``.

    A chat stream opens with the assistant's role, sent with the first token as
    vLLM sends it (its first engine output), not before: the first body bytes
    are the time to first token for whoever times them (policyd's latency
    models, its objectives met).
    """
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    opening = [_event(reply.role_chunk())] if reply.call.chat else []
    sent = 0
    while not state.finished:
        await progress.wait()
        events = []
        if state.generated > sent:
            events, opening = opening, []
        for position in range(sent, state.generated):
            last = state.finished and position == state.generated - 1
            chunk = reply.token_chunk(
                token_text(text_seed, position), state.finish_reason if last else None
            )
            events.append(_event(chunk))
        sent = state.generated
        await response.write(b"".join(events))
    tail = opening + (
        [_event(reply.usage_chunk(state.generated, state.cached_tokens))]
        if reply.call.include_usage
        else []
    )
    await response.write(b"".join([*tail, b"data: [DONE]\n\n"]))
    await response.write_eof()
    return response


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + encode(payload) + b"\n\n"


def _json(payload: dict[str, Any], status: int) -> web.Response:
    return web.Response(body=encode(payload), status=status, content_type="application/json")


def _model_card(model: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": _CREATED,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_len,
    }
