"""Scrape rounds over real loopback HTTP, against stand-in model-server pods."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

from policyd.pool.metric_names import VLLM
from policyd.pool.scraper import ScrapeConfig, ScrapeLoop, Scraper, ScrapeResult

from .model_server import VLLM_SAMPLE, MetricsServer, vllm_text

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def serve(servers: list[MetricsServer], text: str = VLLM_SAMPLE) -> MetricsServer:
    server = MetricsServer(text)
    await server.start()
    servers.append(server)
    return server


class RawServer:
    """A bare TCP server on loopback for responses aiohttp would not send."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._server: asyncio.Server | None = None
        self.connections = 0
        self.address = ""

    async def __aenter__(self) -> RawServer:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self._handler(reader, writer)
            finally:
                writer.close()

        self._server = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


async def requests_on(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The request heads a connection sends, until the client closes it."""
    while True:
        try:
            yield await read_request(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            return


async def scrape(
    address: str, *, rounds: int = 1, config: ScrapeConfig | None = None
) -> list[ScrapeResult]:
    """One pod's results over ``rounds`` rounds of one scraper (closed afterwards)."""
    scraper = Scraper(config or ScrapeConfig(interval=5.0))
    try:
        return [(await scraper.scrape([address]))[0] for _ in range(rounds)]
    finally:
        await scraper.close()


def errors(results: list[ScrapeResult]) -> list[str | None]:
    return [result.error for result in results]


BODY = vllm_text(waiting=2, running=5, kv_cache=0.5).encode()


def assert_two_answers_of_body(results: list[ScrapeResult]) -> None:
    """Two rounds, each read BODY's numbers."""
    assert errors(results) == [None, None]
    assert [(r.metrics.waiting_queue, r.metrics.running) for r in results if r.metrics] == [
        (2, 5),
        (2, 5),
    ]


def write_framed(writer: asyncio.StreamWriter, page: bytes, framing: str, chunk: int) -> None:
    """A 200 answer framed by ``content-length``, ``chunked`` (``chunk`` bytes a
    chunk) or anything else: ended by closing the connection."""
    if framing == "content-length":
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(page), page))
    elif framing == "chunked":
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for start in range(0, len(page), chunk):
            piece = page[start : start + chunk]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        writer.write(b"0\r\n\r\n")
    else:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + page)


async def two_answers_on_one_connection(handler: Handler) -> None:
    """Two rounds against ``handler`` read BODY twice over one kept-alive connection."""
    async with RawServer(handler) as server:
        results = await scrape(server.address, rounds=2)
        assert server.connections == 1
    assert_two_answers_of_body(results)


def answering_until_closed(closed: asyncio.Event) -> Handler:
    """A keep-alive server answering BODY; sets ``closed`` when the client hangs up."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in requests_on(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
            await writer.drain()
        closed.set()

    return handler


async def test_a_round_scrapes_every_pod_concurrently(servers: list[MetricsServer]) -> None:
    texts = [vllm_text(waiting=i, running=10 + i, kv_cache=i / 10) for i in range(3)]
    pods = [await serve(servers, text) for text in texts]
    scraper = Scraper(ScrapeConfig(interval=5.0))
    try:
        results = await scraper.scrape([pod.address for pod in pods])
    finally:
        await scraper.close()
    assert [r.address for r in results] == [pod.address for pod in pods]
    for i, result in enumerate(results):
        assert result.ok, result.error
        assert result.metrics is not None
        assert (result.metrics.waiting_queue, result.metrics.running) == (i, 10 + i)
        assert result.metrics.kv_cache == pytest.approx(i / 10)
        assert result.latency > 0


@contextlib.asynccontextmanager
async def peer_recording_server() -> AsyncIterator[tuple[str, set[object]]]:
    """A metrics endpoint that records the client address of every scrape."""
    peers: set[object] = set()

    async def metrics(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.add(request.transport.get_extra_info("peername"))
        return web.Response(body=BODY)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"127.0.0.1:{port}", peers
    finally:
        await runner.cleanup()


async def test_rounds_reuse_one_kept_alive_connection_per_pod() -> None:
    async with peer_recording_server() as (address, peers):
        results = await scrape(address, rounds=5)
    assert errors(results) == [None] * 5
    assert len(peers) == 1


async def test_a_hanging_pod_times_out_without_holding_up_the_others(
    servers: list[MetricsServer],
) -> None:
    healthy = await serve(servers)
    hanging = await serve(servers)
    hanging.hang()
    scraper = Scraper(ScrapeConfig(interval=1.0, timeout=1.0))  # the healthy pod answers in time
    try:
        results = await scraper.scrape([healthy.address, hanging.address])
        assert results[0].ok, results[0].error
        assert results[1].error == "no answer within 1000 ms"
        assert results[1].latency >= 1.0
        # The abandoned connection is not reused: a late answer cannot be mistaken.
        hanging._hanging = False
        (again,) = await scraper.scrape([hanging.address])
        assert again.ok, again.error
    finally:
        await scraper.close()


async def test_a_pod_that_went_away_fails_to_connect(servers: list[MetricsServer]) -> None:
    pod = await serve(servers)
    scraper = Scraper(ScrapeConfig(interval=5.0))
    try:
        (first,) = await scraper.scrape([pod.address])
        assert first.ok
        await pod.stop()
        (second,) = await scraper.scrape([pod.address])
        assert second.error is not None
        assert second.error.startswith("cannot connect")
    finally:
        await scraper.close()


async def test_an_error_status_fails_the_scrape(servers: list[MetricsServer]) -> None:
    pod = await serve(servers)
    pod.status = 503
    scraper = Scraper(ScrapeConfig(interval=5.0))
    try:
        (result,) = await scraper.scrape([pod.address])
        assert result.error == "HTTP status 503"
        pod.status = 200
        (result,) = await scraper.scrape([pod.address])
        assert result.ok
    finally:
        await scraper.close()


async def test_bad_exposition_text_fails_the_scrape_with_the_line(
    servers: list[MetricsServer],
) -> None:
    pod = await serve(servers, VLLM_SAMPLE.replace("} 3.0", "} three"))
    (result,) = await scrape(pod.address)
    assert result.error == (
        "bad metrics: line 3: vllm:num_requests_running: value 'three' is not a number"
    )


async def test_a_chunked_response_is_reassembled() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in requests_on(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for start in range(0, len(BODY), 40):
                piece = BODY[start : start + 40]
                writer.write(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\nX-Trailer: yes\r\n\r\n")
            await writer.drain()

    await two_answers_on_one_connection(handler)


async def test_a_body_ended_by_closing_the_connection_is_read() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + BODY)
        await writer.drain()

    async with RawServer(handler) as server:
        results = await scrape(server.address, rounds=2)
        assert server.connections == 2
    assert errors(results) == [None, None]


async def test_a_kept_alive_connection_closed_by_the_server_is_retried_once() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Answers one request, then closes as the next arrives (an idle timeout race).
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
        await writer.drain()
        await read_request(reader)

    async with RawServer(handler) as server:
        results = await scrape(server.address, rounds=3)
        assert server.connections == 3
    assert errors(results) == [None] * 3


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x response"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n", "exceeds"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", "closed before the response"),
    ],
)
async def test_broken_responses_fail_with_a_reason(response: bytes, error: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(response)
        await writer.drain()

    async with RawServer(handler) as server:
        config = ScrapeConfig(interval=5.0, max_body_bytes=1024 * 1024)
        (result,) = await scrape(server.address, config=config)
    assert result.error is not None
    assert error in result.error


async def test_the_request_is_a_plain_get_of_the_metrics_path() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
        await writer.drain()

    async with RawServer(handler) as server:
        names = dataclasses.replace(VLLM, path="/custom/metrics")
        (result,) = await scrape(server.address, config=ScrapeConfig(interval=5.0, metrics=names))
    assert result.ok, result.error
    request = seen[0].decode()
    assert request.startswith(
        "GET /custom/metrics?name%5B%5D=vllm%3Anum_requests_waiting"
        "&name%5B%5D=vllm%3Anum_requests_running&name%5B%5D=vllm%3Akv_cache_usage_perc"
        "&name%5B%5D=vllm%3Agpu_cache_usage_perc&name%5B%5D=vllm%3Alora_requests_info"
        "&name%5B%5D=vllm%3Anum_preemptions_total&name%5B%5D=vllm%3Acache_config_info"
        " HTTP/1.1\r\n"
    )
    assert f"Host: {server.address}\r\n" in request
    assert "Accept-Encoding: identity\r\n" in request


@pytest.mark.parametrize("filtered", [True, False])
async def test_prometheus_client_servers_send_only_the_families_asked_for(
    filtered: bool,
) -> None:
    # Model servers publish through prometheus_client, as this real
    # prometheus_client HTTP server on loopback does.
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "w", registry=registry).set(4)
    Gauge("vllm:num_requests_running", "r", registry=registry).set(6)
    Gauge("vllm:kv_cache_usage_perc", "k", registry=registry).set(0.5)
    latency = Histogram("vllm:e2e_request_latency_seconds", "e2e", registry=registry)
    latency.observe(0.2)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    address = f"127.0.0.1:{server.server_port}"
    scraper = Scraper(ScrapeConfig(interval=1.0, filter_families=filtered))
    try:
        (result,) = await scraper.scrape([address])
        body = scraper._rounds._endpoints[address].body
    finally:
        await scraper.close()
        server.shutdown()
        thread.join()
    assert result.metrics is not None, result.error
    assert (result.metrics.waiting_queue, result.metrics.running) == (4, 6)
    assert body is not None
    assert (b"e2e_request_latency" in bytes(body)) is not filtered


async def test_the_metrics_port_overrides_the_pod_port(servers: list[MetricsServer]) -> None:
    pod = await serve(servers)
    metrics_port = int(pod.address.rsplit(":", 1)[1])
    config = ScrapeConfig(interval=5.0, metrics_port=metrics_port)
    (result,) = await scrape("127.0.0.1:1", config=config)
    assert result.address == "127.0.0.1:1"
    assert result.ok, result.error


async def test_retain_closes_the_connections_of_pods_that_left() -> None:
    closed = asyncio.Event()
    handler = answering_until_closed(closed)

    scraper = Scraper(ScrapeConfig(interval=5.0))
    try:
        async with RawServer(handler) as server:
            (result,) = await scraper.scrape([server.address])
            assert result.ok, result.error
            scraper.retain([server.address])
            await asyncio.sleep(0.05)
            assert not closed.is_set()
            scraper.retain([])
            await asyncio.wait_for(closed.wait(), 30)
    finally:
        await scraper.close()


async def test_a_pod_that_leaves_during_a_round_gets_its_result_at_once(
    servers: list[MetricsServer],
) -> None:
    healthy = await serve(servers)
    hanging = await serve(servers)
    hanging.hang()
    scraper = Scraper(ScrapeConfig(interval=60.0))  # a 45 s timeout the round must not wait for
    try:
        round_ = asyncio.create_task(scraper.scrape([healthy.address, hanging.address]))
        async with asyncio.timeout(30):
            while hanging.requests == 0:
                await asyncio.sleep(0.005)
        scraper.retain([healthy.address])
        results = await asyncio.wait_for(round_, 30)
    finally:
        await scraper.close()
    assert results[0].ok, results[0].error
    assert results[1].error == "the pod left the pool"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": 0}, "interval must be positive"),
        ({"interval": 0.1, "timeout": 0.2}, "at most the interval"),
        ({"interval": 0.1, "stale_after": 0.05}, "at least the interval"),
        ({"metrics_port": 70000}, "not a port"),
    ],
)
def test_inconsistent_scrape_settings_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScrapeConfig(**kwargs)  # type: ignore[arg-type]


def test_scrape_defaults_follow_the_interval() -> None:
    config = ScrapeConfig(interval=0.2)
    assert config.request_timeout == pytest.approx(0.15)
    assert config.stale_threshold == pytest.approx(1.0)


async def test_bytes_beyond_the_response_retire_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in requests_on(reader):
            response = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
            writer.write(response + b"HTTP/1.1 200 OK\r\n")  # out of step
            await writer.drain()

    async with RawServer(handler) as server:
        results = await scrape(server.address, rounds=2)
        assert server.connections == 2
    assert errors(results) == [None, None]


@pytest.mark.parametrize("framing", ["content-length", "chunked", "close"])
async def test_pages_larger_than_the_receive_buffer_are_read_whole(framing: str) -> None:
    padding = "".join(f"# HELP filler_{i} {'x' * 90}\n" for i in range(3000))  # ~300 KB
    page = (padding + vllm_text(waiting=3, running=4)).encode()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in requests_on(reader):
            write_framed(writer, page, framing, 50_000)
            await writer.drain()
            if framing == "close":
                return

    async with RawServer(handler) as server:
        results = await scrape(server.address, rounds=2, config=ScrapeConfig(interval=1.0))
    assert errors(results) == [None, None]
    assert [(r.metrics.waiting_queue, r.metrics.running) for r in results if r.metrics] == [
        (3, 4),
        (3, 4),
    ]


async def test_a_server_answering_the_family_filter_with_too_little_gets_asked_for_all() -> None:
    # prometheus_client before 0.25 in multiprocess mode answers name[]= with nothing.
    targets: list[str] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for request in requests_on(reader):
            target = request.split(b" ")[1].decode()
            targets.append(target)
            body = b"" if "?" in target else BODY
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async with RawServer(handler) as server:
        results = await scrape(server.address, rounds=3)
    assert errors(results) == [None] * 3
    assert targets[0].startswith("/metrics?name%5B%5D=")
    assert targets[1:] == ["/metrics"] * 3


async def test_an_idle_connection_the_server_closed_is_replaced_before_the_next_request() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)  # one answer per connection, then an idle close
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
        await writer.drain()

    async with RawServer(handler) as server:
        scraper = Scraper(ScrapeConfig(interval=5.0))
        try:
            results = []
            for _ in range(3):
                results += await scraper.scrape([server.address])
                await asyncio.sleep(0.05)  # the close arrives between rounds
        finally:
            await scraper.close()
        assert server.connections == 3
    assert errors(results) == [None] * 3


async def test_a_response_arriving_in_pieces_is_framed_across_reads() -> None:
    response = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in requests_on(reader):
            for cut in (0, 10, 30, 60, 200):  # inside the status line, the head, the body
                writer.write(response[cut : {0: 10, 10: 30, 30: 60, 60: 200}.get(cut)])
                await writer.drain()
                await asyncio.sleep(0.01)

    await two_answers_on_one_connection(handler)


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-length: %d\r\n"
        b"content-type: text/plain; version=0.0.4\r\n\r\n",  # lower case, as uvicorn sends
        b"HTTP/1.0 200 OK\r\nCONNECTION: Keep-Alive\r\nCONTENT-LENGTH:%d  \r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nContent-Length: 1\r\n\r\n",  # first wins
    ],
)
async def test_framing_headers_are_read_in_any_case(head: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in requests_on(reader):
            writer.write(head % len(BODY) + BODY)
            await writer.drain()

    await two_answers_on_one_connection(handler)


async def test_a_chunked_coding_named_in_capitals_is_reassembled() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in requests_on(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nTRANSFER-ENCODING: Chunked\r\n\r\n")
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY))
            await writer.drain()

    await two_answers_on_one_connection(handler)


async def test_a_response_in_pieces_is_kept_apart_from_whole_pages_read_meanwhile() -> None:
    # A response's first read goes to a buffer every endpoint shares: one
    # still incomplete must be moved out before other pods' pages land there
    # (they would overwrite its first bytes, where its numbers are).
    slow_page = vllm_text(waiting=7, running=1).encode()
    slow = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(slow_page), slow_page)

    async def in_two_parts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in requests_on(reader):
            writer.write(slow[:200])  # the head and the numbers
            await writer.drain()
            await asyncio.sleep(0.06)
            writer.write(slow[200:])
            await writer.drain()

    async def whole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in requests_on(reader):
            await asyncio.sleep(0.02)  # between the slow pod's two parts
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
            await writer.drain()

    async with RawServer(in_two_parts) as a, RawServer(whole) as b, RawServer(whole) as c:
        scraper = Scraper(ScrapeConfig(interval=2.0))
        try:
            rounds = [await scraper.scrape([a.address, b.address, c.address]) for _ in range(2)]
        finally:
            await scraper.close()
    for results in rounds:
        assert errors(results) == [None, None, None]
        assert [(r.metrics.waiting_queue, r.metrics.running) for r in results if r.metrics] == [
            (7, 1),
            (2, 5),
            (2, 5),
        ]


async def test_a_connection_reset_in_the_middle_of_the_body_fails_the_scrape() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY[:50]))
        await writer.drain()
        writer.transport.abort()  # a reset, not an orderly close

    async with RawServer(handler) as server:
        (result,) = await scrape(server.address)
    assert result.error is not None
    assert result.error.startswith("connection closed before the response was complete")


@pytest.mark.parametrize("framing", ["content-length", "chunked", "close"])
async def test_a_body_over_the_size_cap_fails_the_scrape(framing: str) -> None:
    page = b"# " + b"x" * 5000 + b"\n" + BODY

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        write_framed(writer, page, framing, 1000)
        await writer.drain()

    async with RawServer(handler) as server:
        config = ScrapeConfig(interval=5.0, max_body_bytes=4096)
        (result,) = await scrape(server.address, config=config)
    assert result.error is not None
    assert "exceeds" in result.error
    assert "4096" in result.error


def test_the_scrape_loop_runs_rounds_on_the_calling_thread() -> None:
    # What the scraper child process runs: no event loop at all.
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "w", registry=registry).set(1)
    Gauge("vllm:num_requests_running", "r", registry=registry).set(2)
    Gauge("vllm:kv_cache_usage_perc", "k", registry=registry).set(0.25)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    rounds = ScrapeLoop(ScrapeConfig(interval=1.0))
    try:
        address = f"127.0.0.1:{server.server_port}"
        results = [rounds.scrape([address, "127.0.0.1:1"]) for _ in range(2)]
    finally:
        rounds.close()
        server.shutdown()
        thread.join()
    for ok, refused in results:
        assert ok.metrics is not None, ok.error
        assert (ok.metrics.waiting_queue, ok.metrics.running, ok.metrics.kv_cache) == (1, 2, 0.25)
        assert refused.error == "cannot connect: Connection refused"
