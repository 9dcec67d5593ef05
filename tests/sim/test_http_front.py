"""The simulated pod over real HTTP on loopback: OpenAI JSON and SSE, errors, metrics, faults."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from policyd.sim.api import OUTPUT_TOKENS_FIELD
from policyd.sim.profile import L4_LLAMA2_7B
from policyd.sim.server import SimServer
from policyd.sim.tokenizer import tokenize

TIME_SCALE = 50.0
BASE = "meta-llama/Llama-2-7b-hf"


@pytest.fixture
async def server() -> AsyncIterator[SimServer]:
    pod = SimServer(port=0, time_scale=TIME_SCALE, seed=3)
    await pod.start()
    try:
        yield pod
    finally:
        await pod.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def post(
    client: aiohttp.ClientSession, server: SimServer, path: str, payload: Any
) -> tuple[int, dict[str, Any]]:
    async with client.post(server.url + path, json=payload) as response:
        return response.status, await response.json()


async def metric_values(client: aiohttp.ClientSession, server: SimServer) -> dict[str, Any]:
    """Every sample of the pod's /metrics: name -> value (lists for labelled families)."""
    async with client.get(server.url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await response.text()
    values: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:lora_requests_info":
                values.setdefault(sample.name, []).append((sample.value, sample.labels))
            elif "le" not in sample.labels and "finished_reason" not in sample.labels:
                values[sample.name] = sample.value
    return values


async def eventually(check: Any, *, seconds: float = 30.0) -> None:
    """Poll an async predicate until true; the generous bound fails only what never happens."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not await check():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# -- OpenAI API ---------------------------------------------------------------------------------


async def test_models_lists_the_base_model_and_every_adapter(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    async with client.get(server.url + "/v1/models") as response:
        assert response.status == 200
        body = await response.json()
    assert body["object"] == "list"
    ids = [card["id"] for card in body["data"]]
    assert ids == [BASE] + [f"adapter-{i}" for i in range(12)]
    assert all(card["parent"] == BASE for card in body["data"][1:])
    assert body["data"][0]["parent"] is None


async def test_health_answers_200(server: SimServer, client: aiohttp.ClientSession) -> None:
    async with client.get(server.url + "/health") as response:
        assert response.status == 200
        assert await response.read() == b""


async def test_a_completion_returns_text_finish_reason_and_usage(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    prompt = "Hello there, world"
    status, body = await post(
        client, server, "/v1/completions", {"model": "adapter-3", "prompt": prompt, "max_tokens": 5}
    )
    assert status == 200
    assert body["object"] == "text_completion" and body["model"] == "adapter-3"
    assert body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length"  # every natural length is >= 50 tokens
    assert len(choice["text"].split()) == 5
    prompt_tokens = len(tokenize(prompt))
    assert prompt_tokens == 5  # beginning of sequence, Hello, there, ",", world
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 5,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_a_client_may_set_the_length_a_pod_writes_below_max_tokens(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    # The length a replayed virtual run drew, in place of the pod's own draw (>= 50).
    payload = {"model": "adapter-3", "prompt": "Hi", "max_tokens": 9, OUTPUT_TOKENS_FIELD: 3}
    status, body = await post(client, server, "/v1/completions", payload)
    assert status == 200
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "stop"
    capped = await post(client, server, "/v1/completions", {**payload, OUTPUT_TOKENS_FIELD: 40})
    assert capped[1]["usage"]["completion_tokens"] == 9  # max_tokens still caps it
    for bad in (0, -2, "3", True, 2.5):
        status, body = await post(
            client, server, "/v1/completions", {**payload, OUTPUT_TOKENS_FIELD: bad}
        )
        assert status == 400 and body["error"]["param"] == OUTPUT_TOKENS_FIELD


async def test_a_repeated_prompt_reports_its_cached_blocks_in_usage(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    prompt = " ".join(f"word{i}" for i in range(40))  # 41 tokens: two full 16-token blocks
    body = {"model": BASE, "prompt": prompt, "max_tokens": 2}
    cached = []
    for _ in range(2):
        status, answer = await post(client, server, "/v1/completions", body)
        assert status == 200
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 32]


async def test_a_chat_completion_returns_an_assistant_message(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    status, body = await post(
        client,
        server,
        "/v1/chat/completions",
        {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert status == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 3
    assert body["usage"]["completion_tokens"] == 3


async def test_a_streamed_completion_is_server_sent_events_with_usage_and_done(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    payload = {
        "model": "adapter-0",
        "prompt": "stream me",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.post(server.url + "/v1/completions", json=payload) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        raw = await response.read()
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    assert all(event.startswith(b"data: ") for event in events[:-1])
    chunks = [json.loads(event[len(b"data: ") :]) for event in events[:-2]]
    token_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(token_chunks) == 4
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert all(chunk["usage"] is None for chunk in token_chunks)
    reasons = [chunk["choices"][0]["finish_reason"] for chunk in token_chunks]
    assert reasons == [None, None, None, "length"]
    assert all(chunk["choices"][0]["text"].startswith(" ") for chunk in token_chunks)
    assert usage_chunk["choices"] == []
    prompt_tokens = len(tokenize("stream me"))
    assert usage_chunk["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 4,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # compact JSON, as vLLM writes it
    assert events[0].startswith(b'data: {"id":"cmpl-')


async def test_a_streamed_chat_opens_with_the_role_and_has_no_usage_unless_asked(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    payload = {
        "model": "adapter-1",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 2,
        "stream": True,
    }
    async with client.post(server.url + "/v1/chat/completions", json=payload) as response:
        raw = await response.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chunks) == 3
    assert all("usage" not in c and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# -- errors -------------------------------------------------------------------------------------


async def test_an_unknown_model_is_a_404_with_an_openai_error(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    status, body = await post(client, server, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404
    assert body == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"prompt": "x"}', "`model` is required"),
        (b'{"model": "adapter-0", "prompt": "x", "max_tokens": 0}', "`max_tokens`"),
        (b'{"model": "adapter-0", "prompt": {"a": 1}}', "`prompt` must be"),
        (
            b'{"model": "adapter-0", "prompt": "x", "stream_options": {"include_usage": true}}',
            "stream=True",
        ),
        (b'{"model": "adapter-0", "prompt": "x", "n": 2}', "`n` must be 1"),
        (b'{"model": "adapter-0", "prompt": "x", "max_tokens": 5000}', "maximum context length"),
    ],
)
async def test_bad_requests_are_400_with_a_clear_message(
    server: SimServer, client: aiohttp.ClientSession, body: bytes, fragment: str
) -> None:
    async with client.post(server.url + "/v1/completions", data=body) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert fragment in error["message"]


# -- time scale and metrics ---------------------------------------------------------------------


async def test_durations_are_reported_in_simulated_seconds(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    # The pod waits the simulated durations, scaled: never less (a loaded machine
    # only makes it later, so there is no upper bound here). That the scale
    # speeds the pod up shows in the tests that wait a generous deadline for
    # what takes tens of simulated seconds (the idle pod's stats logs).
    loop = asyncio.get_running_loop()
    began = loop.time()
    status, _ = await post(
        client, server, "/v1/completions", {"model": BASE, "prompt": "time", "max_tokens": 5}
    )
    elapsed = loop.time() - began
    assert status == 200
    profile = server.profile
    simulated = profile.prefill_step_s(2) + 4 * profile.decode_step_s(1)  # prefill, 4 decodes
    assert elapsed >= 0.99 * simulated / TIME_SCALE
    values = await metric_values(client, server)
    assert values["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(simulated, abs=1e-6)
    assert values["vllm:time_to_first_token_seconds_sum"] == pytest.approx(0.04, abs=1e-6)
    assert simulated == pytest.approx(0.04 + 4 * 0.0608)
    assert values["vllm:time_per_output_token_seconds_count"] == 4
    assert values["vllm:generation_tokens_total"] == 5


async def test_metrics_show_a_running_request_and_its_adapter(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    # ~5 s of wall time: still running when a loaded machine gets to look
    payload = {"model": "adapter-7", "prompt": "long one", "max_tokens": 4000}
    request = asyncio.create_task(post(client, server, "/v1/completions", payload))

    async def running() -> bool:
        values = await metric_values(client, server)
        return bool(values["vllm:num_requests_running"] == 1)

    await eventually(running)
    values = await metric_values(client, server)
    newest_value, newest_labels = max(values["vllm:lora_requests_info"], key=lambda s: s[0])
    assert newest_labels == {
        "running_lora_adapters": "adapter-7",
        "max_lora": "4",
        "waiting_lora_adapters": "",
    }
    assert newest_value > 1.7e9  # Unix time
    assert values["vllm:kv_cache_usage_perc"] > 0
    assert values["vllm:kv_cache_usage_perc"] == values["vllm:gpu_cache_usage_perc"]
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request


async def test_an_idle_pod_publishes_its_lora_state_each_time_it_logs_its_stats(
    client: aiohttp.ClientSession,
) -> None:
    # vLLM's API server logs the engine's stats every VLLM_LOG_STATS_INTERVAL,
    # busy or idle: a pod that never served shows its adapter slots from its
    # first log on (here every 50 simulated seconds, 1 s of wall time).
    profile = L4_LLAMA2_7B.with_changes(log_stats_interval_s=50.0)
    pod = SimServer(profile, port=0, time_scale=TIME_SCALE)
    await pod.start()
    try:
        assert "vllm:lora_requests_info" not in await metric_values(client, pod)

        async def logged(after: float) -> bool:
            series = (await metric_values(client, pod)).get("vllm:lora_requests_info", [])
            return any(value > after for value, _ in series)

        await eventually(lambda: logged(0.0))
        [(first, labels)] = (await metric_values(client, pod))["vllm:lora_requests_info"]
        assert labels == {"running_lora_adapters": "", "max_lora": "4", "waiting_lora_adapters": ""}
        assert first > 1.7e9  # Unix time
        await eventually(lambda: logged(first))  # set again at the next log, one series still
        assert len((await metric_values(client, pod))["vllm:lora_requests_info"]) == 1
    finally:
        await pod.stop()


async def test_a_client_that_goes_away_aborts_its_request(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    # ~5 s of wall time: the abort lands long before it could finish, even under load
    payload = {"model": "adapter-2", "prompt": "bye", "max_tokens": 4000, "stream": True}
    async with client.post(server.url + "/v1/completions", json=payload) as response:
        await response.content.readuntil(b"\n\n")
        response.close()

    async def idle() -> bool:
        return not server.driver.engine.has_work

    await eventually(idle)
    assert server.driver.engine.stats.finished == {}


# -- fault knobs --------------------------------------------------------------------------------


async def test_failing_requests_over_http_and_healing(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    status, faults = await post(client, server, "/sim/faults", {"fail_requests": 503})
    assert (status, faults) == (200, {"fail_requests": 503, "hang_metrics": False})
    completion = {"model": "adapter-0", "prompt": "x", "max_tokens": 2}
    status, body = await post(client, server, "/v1/completions", completion)
    assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
    async with client.get(server.url + "/health") as response:
        assert response.status == 200
    async with client.get(server.url + "/sim/faults") as response:
        assert (await response.json())["fail_requests"] == 503
    assert await post(client, server, "/sim/faults", {}) == (
        200,
        {"fail_requests": None, "hang_metrics": False},
    )
    status, body = await post(client, server, "/v1/completions", completion)
    assert status == 200 and body["usage"]["completion_tokens"] == 2


async def test_a_hung_metrics_endpoint_answers_once_released(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    assert (await post(client, server, "/sim/faults", {"hang_metrics": True}))[0] == 200
    pending = asyncio.create_task(client.get(server.url + "/metrics"))

    async def held() -> bool:
        return server.metrics_held == 1

    await eventually(held)  # the pod has the request and keeps it
    assert not pending.done()
    async with client.get(server.url + "/health") as response:
        assert response.status == 200
    server.set_faults()
    response = await asyncio.wait_for(pending, 30)
    assert response.status == 200
    assert "vllm:num_requests_waiting" in await response.text()
    response.release()


async def test_a_pod_that_goes_away_refuses_connections_then_comes_back_fresh(
    server: SimServer, client: aiohttp.ClientSession
) -> None:
    completion = {"model": "adapter-0", "prompt": "x", "max_tokens": 2}
    assert (await post(client, server, "/v1/completions", completion))[0] == 200
    port = server.port
    # 5 s of wall time away: long enough for a loaded machine to see the refusal
    status, _ = await post(client, server, "/sim/faults", {"go_away_for": 250.0})
    assert status == 200

    async def refused() -> bool:
        try:
            async with aiohttp.ClientSession() as fresh, fresh.get(server.url + "/health"):
                return False
        except aiohttp.ClientConnectionError:
            return True

    await eventually(refused)

    async def back() -> bool:
        return not await refused()

    await eventually(back)
    assert server.port == port
    values = await metric_values(client, server)
    assert values["vllm:generation_tokens_total"] == 0  # a restarted pod starts from zero


async def test_fault_knobs_from_python(server: SimServer, client: aiohttp.ClientSession) -> None:
    server.set_faults(fail_status=500)
    status, body = await post(client, server, "/v1/completions", {"model": BASE, "prompt": "x"})
    assert status == 500 and body["error"]["code"] == 500
    server.set_faults()
    await server.go_away()
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as fresh, fresh.get(server.url + "/health"):
            pass
    await server.come_back()
    async with client.get(server.url + "/health") as response:
        assert response.status == 200
    with pytest.raises(ValueError, match="4xx or 5xx"):
        server.set_faults(fail_status=200)


@pytest.mark.parametrize(
    "payload",
    [{"explode": True}, {"fail_requests": "yes"}, {"hang_metrics": 1}, {"go_away_for": -1}],
)
async def test_bad_fault_requests_are_400(
    server: SimServer, client: aiohttp.ClientSession, payload: dict[str, Any]
) -> None:
    status, body = await post(client, server, "/sim/faults", payload)
    assert status == 400 and body["error"]["type"] == "BadRequestError"
    assert server.faults.fail_status is None and not server.faults.hang_metrics
