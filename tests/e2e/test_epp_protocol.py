"""The endpoint-picker protocol as gateways call it, through the real Envoy, in each body mode.

``policyd envoy-config --ext-proc-mode inference-pool`` shapes the ext_proc
filter as Istio generates it for an InferencePool (FULL_DUPLEX_STREAMED
request and response bodies, trailers sent); ``buffered`` is policyd's own
(BUFFERED request body, STREAMED response body). Every test here runs in
both: the request reaches the pod the router picks with its body echoed (or
rewritten), a stream comes back live with its usage read, a body of many
chunks and request and response trailers get through, the proxy's endpoint
subset is honoured, a malformed body is a JSON 400, and every ext_proc stream
ends cleanly.

Trailers and the subset need what the generated bootstrap leaves out, so a
second Envoy runs a variant of it (``variant_bootstrap``): HTTP/1 trailers
enabled on the listener and the model cluster, and a Lua filter that puts the
request's ``x-test-subset`` header into the ``envoy.lb.subset_hint``
metadata, as a gateway that computes subsets does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml
from e2e_rig import Gateway, settled, start_gateway, stop_gateway, until
from e2e_support import SSE_USAGE, Snapshot, sse_events
from multidict import CIMultiDict

from policyd.extproc.envoy_config import EXT_PROC_MODES, EnvoyConfigOptions, bootstrap
from policyd.extproc.envoy_process import EnvoyProcess, free_port
from policyd.extproc.epp import SUBSET_KEY, SUBSET_NAMESPACE
from policyd.extproc.replies import DESTINATION_HEADER
from policyd.pool.pod import Pod

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

COMPLETIONS = "/v1/completions"
TRAILER_USAGE = {"prompt_tokens": 21, "completion_tokens": 4}


# -- an upstream that speaks HTTP/1.1 trailers, which aiohttp's server cannot -------------


@dataclass
class TrailerUpstream:
    """A model-server stand-in on a raw socket: reads a chunked request with its
    trailers, answers JSON in chunks followed by a trailer, and records what it got."""

    received: list[tuple[bytes, dict[str, str]]] = field(default_factory=list)
    server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                headers = parse_headers(head)
                body, trailers = await read_body(reader, headers)
                self.received.append((body, trailers))
                answer = json.dumps({"id": "cmpl-t", "choices": [], "usage": TRAILER_USAGE})
                half = len(answer) // 2
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"transfer-encoding: chunked\r\ntrailer: x-upstream-trailer\r\n"
                    b"x-test-upstream: pod-t\r\n\r\n"
                    + chunk(answer[:half].encode())
                    + chunk(answer[half:].encode())
                    + b"0\r\nx-upstream-trailer: done\r\n\r\n"
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def parse_headers(head: bytes) -> dict[str, str]:
    """The header block's fields (names lower-cased); the start line under ``""``."""
    lines = head.decode().split("\r\n")
    fields = {"": lines[0]}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
    return fields


async def read_body(
    reader: asyncio.StreamReader, headers: dict[str, str]
) -> tuple[bytes, dict[str, str]]:
    """A message body (chunked, with its trailers, or of a content-length)."""
    if headers.get("transfer-encoding", "").lower() != "chunked":
        return await reader.readexactly(int(headers.get("content-length", "0"))), {}
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            break
        body += await reader.readexactly(size)
        await reader.readexactly(2)
    trailers = parse_headers(b"start\r\n" + await reader.readuntil(b"\r\n"))
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        trailers.update(parse_headers(b"start\r\n" + line))
    trailers.pop("")
    return bytes(body), trailers


async def raw_request(
    port: int, body: bytes, headers: dict[str, str], trailers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes, dict[str, str]]:
    """One HTTP/1.1 POST, its body chunked (with ``trailers``): status, headers, body,
    trailers of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = f"POST {COMPLETIONS} HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n"
        head += "content-type: application/json\r\ntransfer-encoding: chunked\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        if trailers:
            head += f"trailer: {', '.join(trailers)}\r\n"
        pieces = [chunk(body[i : i + 1000]) for i in range(0, len(body), 1000)]
        tail = "".join(f"{name}: {value}\r\n" for name, value in (trailers or {}).items())
        writer.write(
            head.encode() + b"\r\n" + b"".join(pieces) + b"0\r\n" + tail.encode() + b"\r\n"
        )
        await writer.drain()
        answer = parse_headers(await reader.readuntil(b"\r\n\r\n"))
        status = int(answer[""].split()[1])
        answer_body, answer_trailers = await read_body(reader, answer)
        return status, answer, answer_body, answer_trailers
    finally:
        writer.close()


# -- the rigs: the generated bootstrap, and its variant with trailers and subsets ---------

LUA_SUBSET = f"""
function envoy_on_request(handle)
  local subset = handle:headers():get("x-test-subset")
  if subset == nil then return end
  local endpoints = {{}}
  for endpoint in string.gmatch(subset, "[^,]+") do table.insert(endpoints, endpoint) end
  if subset == "none" then endpoints = {{}} end
  handle:streamInfo():dynamicMetadata():set("{SUBSET_NAMESPACE}", "{SUBSET_KEY}", endpoints)
end
"""


def variant_bootstrap(options: EnvoyConfigOptions) -> dict[str, Any]:
    """The generated bootstrap with HTTP/1 trailers on and a Lua filter setting the
    subset metadata from ``x-test-subset`` (forwarded to policyd in either mode)."""
    config = bootstrap(options)
    resources = config["static_resources"]
    manager = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_protocol_options"] = {"enable_trailers": True}
    lua = {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": LUA_SUBSET},
        },
    }
    filters = manager["http_filters"]
    filters.insert(0, lua)
    forwarding = filters[1]["typed_config"]["metadata_options"].setdefault(
        "forwarding_namespaces", {"untyped": []}
    )
    if SUBSET_NAMESPACE not in forwarding["untyped"]:
        forwarding["untyped"].append(SUBSET_NAMESPACE)
    (model_cluster,) = [c for c in resources["clusters"] if c["name"] == "model_servers"]
    model_cluster["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http_protocol_options": {"enable_trailers": True}},
        }
    }
    return config


@dataclass
class Rig:
    mode: str
    gateway: Gateway
    variant: EnvoyProcess
    variant_port: int
    trailer_upstream: TrailerUpstream

    @property
    def variant_url(self) -> str:
        return f"http://127.0.0.1:{self.variant_port}"


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=EXT_PROC_MODES)
async def rig(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Rig]:
    mode: str = request.param
    tmp = tmp_path_factory.mktemp(mode)
    gateway = await start_gateway(tmp, EnvoyConfigOptions(ext_proc_mode=mode))
    trailer_upstream = TrailerUpstream()
    variant: EnvoyProcess | None = None
    try:
        await trailer_upstream.start()
        gateway.pool.snapshot = Snapshot(
            (*gateway.pool.snapshot.candidates, Pod("pod-t", trailer_upstream.address))
        )
        options = dataclasses.replace(
            EnvoyConfigOptions(ext_proc_mode=mode),
            port=free_port(),
            admin_port=free_port(),
            policyd_port=gateway.server.port,
        )
        (tmp / "variant").mkdir()
        config = tmp / "variant" / "envoy.yaml"
        config.write_text(yaml.safe_dump(variant_bootstrap(options)))
        variant = EnvoyProcess(
            config,
            options.admin_port,
            listen_port=options.port,
            log_file=config.with_suffix(".log"),
        )
        variant.start()
        await variant.wait_ready()
        yield Rig(mode, gateway, variant, options.port, trailer_upstream)
    finally:
        if variant is not None:
            variant.stop()
        await trailer_upstream.stop()
        await stop_gateway(gateway)


async def post(
    url: str, rig: Rig, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, CIMultiDict[str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with rig.gateway.client.post(
        url + COMPLETIONS,
        data=data,
        headers={"content-type": "application/json", **(headers or {})},
    ) as response:
        return response.status, CIMultiDict(response.headers), await response.read()


def in_flight(rig: Rig) -> dict[str, int]:
    return {pod.name: pod.in_flight for pod in rig.gateway.pool.snapshot.candidates}


def received(rig: Rig) -> int:
    upstreams = rig.gateway.upstreams.values()
    return sum(len(u.received) for u in upstreams) + len(rig.trailer_upstream.received)


# -- the tests ------------------------------------------------------------------------------


async def test_each_request_reaches_the_pod_the_router_picks_with_its_body(rig: Rig) -> None:
    gateway = rig.gateway
    body = {"model": "m", "prompt": "héllo", "max_tokens": 3}
    for pick in ("pod-b", "pod-a"):
        status, headers, answer = await post(gateway.url, rig, body, {"x-test-pick": pick})
        assert status == 200, answer
        assert headers["x-test-upstream"] == pick
        got = gateway.upstreams[pick].received[-1]
        assert got.headers[DESTINATION_HEADER] == gateway.upstreams[pick].address
        assert got.body == json.dumps(body).encode()  # echoed byte for byte
    assert set(in_flight(rig).values()) == {0}


async def test_a_stream_comes_back_live_and_its_usage_is_read(rig: Rig) -> None:
    gateway = rig.gateway
    upstream = gateway.upstreams["pod-b"]
    upstream.release_stream.clear()
    expected = sse_events("m")
    async with gateway.client.post(
        gateway.url + COMPLETIONS,
        json={"model": "m", "prompt": "hi", "stream": True},
        headers={"x-test-pick": "pod-b"},
    ) as response:
        assert response.status == 200
        # The first event reaches the client while the pod holds back the rest.
        first = await asyncio.wait_for(response.content.readexactly(len(expected[0])), 30)
        assert gateway.pods["pod-b"].in_flight == 1
        upstream.release_stream.set()
        rest = await response.content.read()
    assert first + rest == b"".join(expected)
    await settled(gateway.server)
    span = gateway.telemetry.spans[gateway.router.seen[-1].id]
    assert span.ended["completed"] is True
    assert (span.ended["prompt_tokens"], span.ended["completion_tokens"]) == (
        SSE_USAGE["prompt_tokens"],
        SSE_USAGE["completion_tokens"],
    )
    assert gateway.pods["pod-b"].in_flight == 0


async def test_a_large_body_sent_in_many_chunks_arrives_whole(rig: Rig) -> None:
    gateway = rig.gateway
    document = json.dumps({"model": "m", "prompt": "z" * (1536 * 1024)}).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(document), 8192):
            yield document[start : start + 8192]

    async with gateway.client.post(
        gateway.url + COMPLETIONS,
        data=pieces(),
        headers={"content-type": "application/json", "x-test-pick": "pod-a"},
    ) as response:
        assert response.status == 200, await response.read()
    assert gateway.upstreams["pod-a"].received[-1].body == document
    assert gateway.router.seen[-1].prompt_tokens == 1536 * 1024 // 4


async def test_a_model_rewrite_reaches_the_pod_in_a_correct_body(rig: Rig) -> None:
    gateway = rig.gateway
    # Over 64 KiB: FULL_DUPLEX_STREAMED hands it back in several streamed pieces.
    body = {"model": "base", "prompt": "q" * 100_000, "max_tokens": 5}
    headers = {"x-test-pick": "pod-a", "x-test-target-model": "base-lora-v2"}
    status, _, answer = await post(gateway.url, rig, body, headers)
    assert status == 200, answer[:200]
    assert json.loads(answer)["model"] == "base-lora-v2"
    assert json.loads(gateway.upstreams["pod-a"].received[-1].body) == {
        **body,
        "model": "base-lora-v2",
    }


async def test_request_and_response_trailers_get_through(rig: Rig) -> None:
    document = json.dumps({"model": "m", "prompt": "t" * 5000}).encode()
    status, headers, body, trailers = await raw_request(
        rig.variant_port, document, {"x-test-pick": "pod-t"}, {"x-client-trailer": "sent"}
    )
    assert status == 200, body
    assert headers["x-test-upstream"] == "pod-t"
    assert json.loads(body)["usage"] == TRAILER_USAGE
    assert trailers == {"x-upstream-trailer": "done"}
    got_body, got_trailers = rig.trailer_upstream.received[-1]
    assert got_body == document
    assert got_trailers == {"x-client-trailer": "sent"}
    span = rig.gateway.telemetry.spans[rig.gateway.router.seen[-1].id]
    # In the buffered shape the end comes with Envoy's reset, after the client's answer.
    await until(lambda: span.end_calls == 1, "the exchange's end to be recorded")
    assert span.ended["prompt_tokens"] == TRAILER_USAGE["prompt_tokens"]
    # policyd's buffered shape skips trailers (response_trailer_mode SKIP), so policyd
    # never sees such a response end: the exchange ends when Envoy resets the stream,
    # recorded as not completed. The inference-pool shape sends them, and answers them.
    assert span.ended["completed"] is (rig.mode == "inference-pool")
    assert set(in_flight(rig).values()) == {0}


async def test_the_proxys_endpoint_subset_is_honoured(rig: Rig) -> None:
    gateway = rig.gateway
    pod_b = gateway.upstreams["pod-b"].address
    body = {"model": "m", "prompt": "p"}
    # The router would pick pod-a (asked for, and first); the subset leaves it pod-b.
    for subset in (pod_b, f"10.9.9.9:1,{pod_b}"):
        headers = {"x-test-pick": "pod-a", "x-test-subset": subset}
        status, answer_headers, answer = await post(rig.variant_url, rig, body, headers)
        assert status == 200, answer
        assert answer_headers["x-test-upstream"] == "pod-b"
    # Without a subset the same request goes where the router says.
    status, answer_headers, _ = await post(rig.variant_url, rig, body, {"x-test-pick": "pod-a"})
    assert (status, answer_headers["x-test-upstream"]) == (200, "pod-a")


@pytest.mark.parametrize("subset", ["10.9.9.9:1", "none"])
async def test_a_subset_with_no_pool_pod_is_a_503_that_no_pod_sees(rig: Rig, subset: str) -> None:
    before = received(rig)
    status, headers, answer = await post(
        rig.variant_url, rig, {"model": "m", "prompt": "p"}, {"x-test-subset": subset}
    )
    assert (status, headers["content-type"]) == (503, "application/json")
    assert json.loads(answer)["error"]["code"] == "no_subset_endpoints"
    assert received(rig) == before


async def test_a_malformed_body_is_a_json_400_and_the_next_request_is_served(rig: Rig) -> None:
    before = received(rig)
    for malformed in (b"{not json", b"[1, 2]", json.dumps({"prompt": "no model"}).encode()):
        status, headers, answer = await post(rig.gateway.url, rig, malformed)
        assert (status, headers["content-type"]) == (400, "application/json")
        assert json.loads(answer)["error"]["type"] == "invalid_request_error"
    assert received(rig) == before
    status, _, _ = await post(rig.gateway.url, rig, {"model": "m", "prompt": "p"})
    assert status == 200


async def test_every_stream_ends_cleanly_and_envoy_stays_up(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = rig.gateway
    caplog.set_level(logging.DEBUG, logger="policyd.extproc")
    gateway.upstreams["pod-a"].release_stream.set()
    errors_before = len(gateway.telemetry.stream_errors)
    spans_before = len(gateway.telemetry.spans)

    async def one(i: int) -> int:
        async with gateway.client.post(
            gateway.url + COMPLETIONS,
            json={"model": "m", "prompt": "hi" * i, "stream": i % 2 == 0},
            headers={"x-test-pick": "pod-a"},
        ) as response:
            await response.read()
            return response.status

    for _ in range(6):
        assert await asyncio.gather(*(one(i) for i in range(10))) == [200] * 10
    await settled(gateway.server)

    def new_spans() -> list[Any]:
        return list(gateway.telemetry.spans.values())[spans_before:]

    # The last streams' ends reach policyd after the responses.
    await until(lambda: all(span.ended for span in new_spans()), "every stream's end")
    spans = new_spans()
    assert len(spans) == 60
    assert all(span.ended["completed"] for span in spans)
    # No stream was reset while policyd still waited on it.
    assert gateway.telemetry.stream_errors[errors_before:] == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert gateway.envoy.process is not None and gateway.envoy.process.poll() is None
    await until(lambda: set(in_flight(rig).values()) == {0}, "in-flight counts back to 0")


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_a_request_without_a_body_reaches_the_least_busy_pod(rig: Rig, method: str) -> None:
    gateway = rig.gateway
    busy = [pod for pod in gateway.pool.snapshot.candidates if pod.name != "pod-b"]
    for pod in busy:
        pod.load.count = 1
    try:
        async with gateway.client.request(method, gateway.url + "/v1/models") as response:
            status, headers = response.status, CIMultiDict(response.headers)
            await response.read()
    finally:
        for pod in busy:
            pod.load.count = 0
    assert status == 200
    assert headers["x-test-upstream"] == "pod-b"
    assert set(in_flight(rig).values()) == {0}


async def test_a_body_past_the_limit_is_a_413_that_no_pod_sees(rig: Rig) -> None:
    """The buffered shape's limit is Envoy's buffer (4 MiB); in FULL_DUPLEX_STREAMED mode
    Envoy buffers nothing, and policyd's own ``--max-body-mib`` (16 MiB) holds."""
    size = 5 * 1024 * 1024 if rig.mode == "buffered" else 17 * 1024 * 1024
    before = received(rig)
    status, _, answer = await post(rig.gateway.url, rig, {"model": "m", "prompt": "z" * size})
    assert status == 413
    if rig.mode == "inference-pool":
        assert json.loads(answer)["error"]["code"] == "body_too_large"
    assert received(rig) == before


async def test_the_inference_pool_shape_fails_closed_and_envoy_stays_up(
    tmp_path: Path,
) -> None:
    """Every response chunk passes through policyd in FULL_DUPLEX_STREAMED mode, so a
    policyd that stops cuts the generations streaming through it, and new requests get
    Envoy's 500 (Istio's default: ``failure_mode_allow`` off, no ``status_on_error``).
    The buffered shape fails open instead (test_stream_close.py)."""
    gateway = await start_gateway(tmp_path, EnvoyConfigOptions(ext_proc_mode="inference-pool"))
    try:
        upstream = gateway.upstreams["pod-b"]
        upstream.release_stream.clear()

        async def generation() -> bool:
            async with gateway.client.post(
                gateway.url + COMPLETIONS,
                json={"model": "m", "prompt": "hi", "stream": True},
                headers={"x-test-pick": "pod-b"},
            ) as response:
                assert response.status == 200
                try:
                    await response.content.readany()
                    streaming.append(True)
                    await response.read()
                except aiohttp.ClientPayloadError:
                    return False
                return True

        streaming: list[bool] = []
        streams = [asyncio.create_task(generation()) for _ in range(4)]
        await until(lambda: len(upstream.received) == 4, "the generations to start")
        await until(lambda: len(streaming) == 4, "their first events at the clients")
        await gateway.server.stop(0)
        await asyncio.sleep(0.3)
        upstream.release_stream.set()
        assert await asyncio.wait_for(asyncio.gather(*streams), 15) == [False] * 4
        before = sum(len(u.received) for u in gateway.upstreams.values())
        async with gateway.client.post(
            gateway.url + COMPLETIONS, json={"model": "m", "prompt": "p"}
        ) as response:
            assert response.status == 500
        assert sum(len(u.received) for u in gateway.upstreams.values()) == before
        assert gateway.envoy.process is not None and gateway.envoy.process.poll() is None
    finally:
        await stop_gateway(gateway)
