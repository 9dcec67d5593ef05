"""Disaggregated prefill/decode through llm-d's real P/D sidecar, against simulated pods.

The chain is the one docs/disaggregation.md describes, every part real except
the two recorders: a client → Envoy → ``policyd serve`` (``rules/pd.yaml``)
picks a decode pod and a prefill pod and names the prefill pod in
``x-prefiller-host-port`` → the decode pod is llm-d's ``pd-sidecar``
(``real-tools.sh pd-sidecar``) in front of a simulator → the sidecar sends
the prefill to the prefill pod (a simulator too) with vLLM's NIXL
``kv_transfer_params`` and then the decode to its own pod with the parameters
the prefill returned.

A ``Recorder`` (a pass-through HTTP proxy written here, named as such) sits in
front of each simulator and keeps what reached it and what it answered: neither
simulator logs request headers nor traces, so the recorder is how the test sees the
``traceparent`` each pod got. Envoy, policyd and the sidecar export spans to a
real Jaeger; the test reads the trace back and checks that it is one tree
across all of them and reaches the prefill pod.

Every test runs twice, once per simulator: llm-d's inference-sim, an
independent implementation of the protocol, and policyd's own (``policyd
sim``), whose prefill pod answers with the ``kv_transfer_params`` the decode pod
needs and whose decode pod then computes only what the transfer did not bring.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from inference_sim import (
    MODEL,
    READY_S,
    REPO,
    Gateway,
    SimPod,
    gateway,
    pod_metrics,
    start_pod,
    stop_pods,
    until_ready,
)
from jaeger_process import Jaeger
from test_inference_sim import success_total, until
from test_jaeger import Span, poll
from traced_gateway import ENVOY_SERVICE

from policyd.extproc.envoy_process import free_port
from policyd.extproc.replies import PREFILL_HEADER

pytestmark = pytest.mark.asyncio(loop_scope="module")

POLICY = REPO / "rules" / "pd.yaml"  # splits at 512 uncached prompt tokens
SHORT = "hello"


def long_prompt(topic: str) -> str:
    """Some 1,900 tokens to policyd's estimate, and about 1,000 words to the simulator's
    tokenizer: split. Each test asks about its own ``topic``, so no pod holds it yet (a
    prompt the decode pod has cached is, rightly, not split again)."""
    return f"{topic}: " + "a retrieved document about disaggregated serving " * 160


SIM_FLAGS = (
    "--time-to-first-token", "5ms", "--inter-token-latency", "2ms", "--seed", "7",
    "--max-model-len", "8192",
)  # fmt: skip
TRANSFER = ("--kv-cache-transfer-latency", "20ms")  # the decode pod's wait for the blocks
SIDECAR_SERVICE = "llm-d-disagg-sidecar"
POLICYD_PROFILE = "l4-llama3.1-8b"  # vLLM V1: the engine that takes a remotely prefilled request
POLICYD_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass(frozen=True)
class Simulator:
    """The model server both pods run: its model, how one pod of a role starts, and the
    metric in which its decode pod counts the KV transfers it read (``None``: none)."""

    name: str
    model: str
    start: Callable[[Callable[[str], str], str, Path, str], Awaitable[SimPod]]
    transfers: str | None


async def start_inference_sim(
    tool: Callable[[str], str], name: str, tmp: Path, role: str
) -> SimPod:
    transfer = TRANSFER if role == "decode" else ()
    return start_pod(tool("inference-sim"), name, tmp, *SIM_FLAGS, *transfer)


async def start_policyd_sim(tool: Callable[[str], str], name: str, tmp: Path, role: str) -> SimPod:
    """One ``policyd sim`` pod of ``role``, on the free port it prints."""
    log = tmp / f"{name}.log"
    command = [
        sys.executable, "-m", "policyd", "sim", "--pods", "1", "--base-port", "0",
        "--profile", POLICYD_PROFILE, "--time-scale", "10", "--roles", role,
    ]  # fmt: skip
    with log.open("wb") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
    assert process.stdout is not None
    await asyncio.to_thread(process.stdout.readline)  # the pool's header
    line = await asyncio.to_thread(process.stdout.readline)
    assert line, f"policyd sim exited: {log.read_text()[-2000:]}"
    url = line.split()[1]
    return SimPod(name, int(url.rsplit(":", 1)[1]), process, log)


SIMULATORS = (
    Simulator("inference-sim", MODEL, start_inference_sim, None),
    # vLLM's NixlConnector histogram: one observation per transfer read
    Simulator("policyd-sim", POLICYD_MODEL, start_policyd_sim, "vllm:nixl_bytes_transferred_count"),
)
COUNTING_TRANSFERS = tuple(s for s in SIMULATORS if s.transfers is not None)


@dataclass
class Seen:
    """One request a recorder passed on, and the answer it passed back."""

    path: str
    headers: dict[str, str]
    body: bytes
    answer: bytearray = field(default_factory=bytearray)


@dataclass
class Recorder:
    """A pass-through HTTP proxy in front of one simulator, keeping what reached it."""

    target: str
    port: int = 0
    seen: list[Seen] = field(default_factory=list)
    runner: web.AppRunner | None = None
    session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=READY_S))
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._pass)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    def completions(self) -> list[Seen]:
        return [s for s in self.seen if s.path.startswith("/v1/")]

    async def _pass(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body = await request.read()
        seen = Seen(request.path, {k.lower(): v for k, v in request.headers.items()}, body)
        self.seen.append(seen)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        async with self.session.request(
            request.method, f"http://{self.target}{request.path_qs}", data=body, headers=headers
        ) as answer:
            response = web.StreamResponse(status=answer.status)
            if "content-type" in answer.headers:
                response.content_type = answer.content_type
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                seen.answer += chunk
                await response.write(chunk)
            await response.write_eof()
            return response


@dataclass
class DecodePod:
    """The sidecar in front of a recorder in front of a simulator: one decode pod."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    def pods_file_entry(self) -> str:
        return (
            f"  - {{name: {self.name}, address: '127.0.0.1:{self.port}', "
            "labels: {role: serving, 'llm-d.ai/role': decode}}\n"
        )


@dataclass
class Chain:
    simulator: Simulator
    gate: Gateway
    client: aiohttp.ClientSession
    decode_sim: SimPod
    prefill_sim: SimPod
    to_decode: Recorder
    to_prefill: Recorder
    sidecar: DecodePod
    jaeger: Jaeger


def start_sidecar(binary: str, tmp: Path, model_server_port: int, otlp: str) -> DecodePod:
    port = free_port()
    log = tmp / "pd-sidecar.log"
    command = [
        binary, "--port", str(port), "--model-server-port", str(model_server_port),
        "--kv-connector", "nixlv2", "--secure-proxy=false", "--tracing",
    ]  # fmt: skip
    environment = {
        **os.environ,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{otlp}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER_ARG": "1",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment)
    return DecodePod("decode-0", port, process, log)


@pytest_asyncio.fixture(
    loop_scope="module", scope="module", params=SIMULATORS, ids=lambda s: s.name
)
async def chain(
    request: pytest.FixtureRequest,
    tool: Callable[[str], str],
    jaeger: Jaeger,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Chain]:
    simulator: Simulator = request.param
    sidecar_binary = tool("pd-sidecar")
    tmp = tmp_path_factory.mktemp("pd")
    decode_sim = await simulator.start(tool, "decode-sim", tmp, "decode")
    try:
        prefill_sim = await simulator.start(tool, "prefill-0", tmp, "prefill")
    except BaseException:
        await stop_pods([decode_sim])
        raise
    to_decode, to_prefill = Recorder(decode_sim.address), Recorder(prefill_sim.address)
    sidecar: DecodePod | None = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=READY_S)) as client:
        try:
            await until_ready(client, [decode_sim, prefill_sim])
            await to_decode.start()
            await to_prefill.start()
            sidecar = start_sidecar(sidecar_binary, tmp, to_decode.port, jaeger.otlp_grpc)
            # policyd knows the prefill pod at its recorder's address: that is the
            # address it names to the sidecar, so the sidecar's prefill passes the recorder.
            prefill = SimPod("prefill-0", to_prefill.port, prefill_sim.process, prefill_sim.log)
            prefill.role = "prefill"
            await until_listening(client, sidecar)
            async with gateway(
                tmp, POLICY, [sidecar, prefill], otlp_endpoint=jaeger.otlp_grpc
            ) as gate:
                yield Chain(
                    simulator,
                    gate,
                    client,
                    decode_sim,
                    prefill_sim,
                    to_decode,
                    to_prefill,
                    sidecar,
                    jaeger,
                )
        finally:
            if sidecar is not None:
                sidecar.process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(sidecar.process.wait, 10)
                if sidecar.process.poll() is None:
                    sidecar.process.kill()
            await to_decode.stop()
            await to_prefill.stop()
            await stop_pods([decode_sim, prefill_sim])


async def until_listening(client: aiohttp.ClientSession, sidecar: DecodePod) -> None:
    """Until the sidecar passes a health check through to its pod."""

    async def answers() -> bool:
        assert sidecar.process.poll() is None, sidecar.log.read_text()[-2000:]
        with contextlib.suppress(aiohttp.ClientError):
            async with client.get(f"http://127.0.0.1:{sidecar.port}/health") as response:
                return response.status == 200
        return False

    await until(answers, "the sidecar")


def completion(chain: Chain, prompt: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": chain.simulator.model, "prompt": prompt, "max_tokens": 5, "stream": stream}


def traced() -> tuple[str, dict[str, str]]:
    """A new trace id, and the ``traceparent`` header that starts a request in it."""
    trace_id = os.urandom(16).hex()
    return trace_id, {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}


async def decision_of(chain: Chain, trace_id: str) -> dict[str, Any]:
    """policyd's logged decision for the request of ``trace_id`` (logged as its exchange
    ends, which may be after the client has its answer)."""

    def logged() -> list[dict[str, Any]]:
        return [d for d in chain.gate.decisions() if d["trace_id"] == trace_id]

    await until(logged, f"the decision of trace {trace_id}")
    (decision,) = logged()
    return decision


async def send(
    chain: Chain,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    path: str = "/v1/completions",
) -> tuple[int, str]:
    url = chain.gate.url + path
    async with chain.client.post(url, json=body, headers=headers or {}) as response:
        return response.status, await response.text()


async def test_a_long_prompt_is_prefilled_on_the_prefill_pod_and_decoded_behind_the_sidecar(
    chain: Chain,
) -> None:
    prefills, decodes = len(chain.to_prefill.completions()), len(chain.to_decode.completions())
    before = success_total(await pod_metrics(chain.client, chain.decode_sim.url))
    prompt = long_prompt("whole")
    trace_id, headers = traced()
    status, text = await send(chain, completion(chain, prompt), headers)
    assert status == 200, text
    assert '"choices"' in text

    (prefill,) = chain.to_prefill.completions()[prefills:]
    sent = json.loads(prefill.body)
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert PREFILL_HEADER not in prefill.headers  # the sidecar does not pass it on
    (decode,) = chain.to_decode.completions()[decodes:]
    received = json.loads(decode.body)
    assert received["kv_transfer_params"]["do_remote_prefill"] is True
    # what the prefill pod answered, passed on whole: where the decode pod reads the blocks
    assert received["kv_transfer_params"] == json.loads(prefill.answer)["kv_transfer_params"]
    assert received["prompt"] == prompt
    await until(
        lambda: _later(chain, before), "the decode simulator counts the request it finished"
    )

    decision = await decision_of(chain, trace_id)
    assert decision["pod"] == "decode-0"
    assert decision["split"]["split"] is True and decision["split"]["reason"] == "when-true"
    assert decision["split"]["pod"] == "prefill-0"
    assert decision["split"]["endpoint"] == f"127.0.0.1:{chain.to_prefill.port}"


async def _later(chain: Chain, before: float) -> bool:
    return success_total(await pod_metrics(chain.client, chain.decode_sim.url)) > before


def _count(samples: dict[str, list[Any]], name: str) -> float:
    return float(sum(s.value for s in samples.get(name, ())))


@pytest.mark.parametrize(
    "chain", COUNTING_TRANSFERS, ids=lambda s: s.name, indirect=True
)  # inference-sim exports no transfer metric
async def test_the_decode_pod_reads_the_prefilled_blocks_once_per_split(chain: Chain) -> None:
    """policyd's simulator counts each transfer its decode pod reads, as vLLM's
    NixlConnector does: one per split request, none for a request decoded whole."""
    metric = chain.simulator.transfers
    assert metric is not None
    url = chain.decode_sim.url
    before = _count(await pod_metrics(chain.client, url), metric)
    status, text = await send(chain, completion(chain, long_prompt("transferred")))
    assert status == 200, text
    assert _count(await pod_metrics(chain.client, url), metric) == before + 1
    status, text = await send(chain, completion(chain, SHORT))
    assert status == 200, text
    assert _count(await pod_metrics(chain.client, url), metric) == before + 1


async def test_a_streamed_long_prompt_is_split_too(chain: Chain) -> None:
    prefills = len(chain.to_prefill.completions())
    status, text = await send(chain, completion(chain, long_prompt("streamed"), stream=True))
    assert status == 200, text
    assert text.rstrip().endswith("data: [DONE]")
    (prefill,) = chain.to_prefill.completions()[prefills:]
    sent = json.loads(prefill.body)
    assert sent["stream"] is False  # the sidecar asks the prefill pod for one whole answer


async def test_a_streamed_chat_is_split_with_its_token_limits_restored(chain: Chain) -> None:
    """The sidecar caps every token limit of the prefill at 1 and gives the decode the
    client's own back."""
    prefills, decodes = len(chain.to_prefill.completions()), len(chain.to_decode.completions())
    body = {
        "model": chain.simulator.model,
        "messages": [{"role": "user", "content": long_prompt("chat")}],
        "max_completion_tokens": 5,
        "stream": True,
    }
    status, text = await send(chain, body, path="/v1/chat/completions")
    assert status == 200, text
    assert text.rstrip().endswith("data: [DONE]")
    (prefill,) = chain.to_prefill.completions()[prefills:]
    assert prefill.path == "/v1/chat/completions"
    sent = json.loads(prefill.body)
    assert (sent["max_tokens"], sent["max_completion_tokens"], sent["stream"]) == (1, 1, False)
    (decode,) = chain.to_decode.completions()[decodes:]
    received = json.loads(decode.body)
    assert received["kv_transfer_params"]["do_remote_prefill"] is True
    assert received["max_completion_tokens"] == 5 and "max_tokens" not in received
    assert received["stream"] is True


async def test_a_prompt_the_decode_pod_holds_is_not_split_again(chain: Chain) -> None:
    """``when`` reads the decode pod's ``pod.prefix_tokens``: after one split the prompt
    is on the decode pod policyd sent it to, so the same prompt is decoded whole there."""
    prompt = long_prompt("again")
    first_trace, first_headers = traced()
    status, text = await send(chain, completion(chain, prompt), first_headers)
    assert status == 200, text
    prefills, decodes = len(chain.to_prefill.completions()), len(chain.to_decode.completions())
    second_trace, second_headers = traced()
    status, text = await send(chain, completion(chain, prompt), second_headers)
    assert status == 200, text
    assert len(chain.to_prefill.completions()) == prefills
    (decode,) = chain.to_decode.completions()[decodes:]
    assert "kv_transfer_params" not in json.loads(decode.body)
    assert (await decision_of(chain, first_trace))["split"]["split"] is True
    assert (await decision_of(chain, second_trace))["split"]["split"] is False


async def test_a_short_prompt_is_decoded_whole_on_the_decode_pod(chain: Chain) -> None:
    prefills, decodes = len(chain.to_prefill.completions()), len(chain.to_decode.completions())
    status, text = await send(chain, completion(chain, SHORT))
    assert status == 200, text
    assert len(chain.to_prefill.completions()) == prefills
    (decode,) = chain.to_decode.completions()[decodes:]
    assert "kv_transfer_params" not in json.loads(decode.body)


async def test_a_client_cannot_send_the_prefill_to_a_pod_of_its_choosing(chain: Chain) -> None:
    """A short prompt with a forged header: the sidecar would prefill on the named host,
    so the header must not reach it."""
    prefills, decodes = len(chain.to_prefill.completions()), len(chain.to_decode.completions())
    forged = {PREFILL_HEADER: f"127.0.0.1:{chain.to_prefill.port}"}
    status, text = await send(chain, completion(chain, SHORT), forged)
    assert status == 200, text
    assert len(chain.to_prefill.completions()) == prefills
    (decode,) = chain.to_decode.completions()[decodes:]
    assert PREFILL_HEADER not in decode.headers


async def test_the_trace_is_one_tree_from_the_gateway_to_the_prefill_pod(chain: Chain) -> None:
    """The client's trace: Envoy's spans, policyd's decision span under them, the sidecar's
    spans under Envoy's upstream call, and the prefill pod called from a sidecar span."""
    trace_id, caller = traced()
    prefills = len(chain.to_prefill.completions())
    status, text = await send(chain, completion(chain, long_prompt("traced")), caller)
    assert status == 200, text
    (prefill,) = chain.to_prefill.completions()[prefills:]
    _, prefill_trace, prefill_parent, _ = prefill.headers["traceparent"].split("-")
    assert prefill_trace == trace_id

    def whole(spans: list[Span]) -> bool:
        services = {s.service for s in spans}
        return {"policyd", SIDECAR_SERVICE, ENVOY_SERVICE} <= services and any(
            s.span_id == prefill_parent for s in spans
        )

    spans = await poll(lambda: chain.jaeger.trace(trace_id), whole)
    by_id = {s.span_id: s for s in spans}

    def ancestry(span: Span) -> list[str]:
        services = []
        while span.parent_id in by_id:
            span = by_id[span.parent_id]
            services.append(span.service)
        return services

    (decision,) = [s for s in spans if s.service == "policyd"]
    assert decision.attributes["policyd.pd.split"] is True
    assert set(ancestry(decision)) == {ENVOY_SERVICE}
    # The prefill pod was called from inside the sidecar, itself called by Envoy's router.
    calling = by_id[prefill_parent]
    assert calling.service == SIDECAR_SERVICE
    assert ENVOY_SERVICE in ancestry(calling)
    roots = [s for s in spans if s.parent_id not in by_id]
    assert len(roots) == 1 and roots[0].service == ENVOY_SERVICE
