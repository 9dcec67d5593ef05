"""What the pool's scraping costs: 100 pods polled at 10 Hz, and the parser alone.

    python benchmarks/scrape.py [--pods 100] [--interval 0.1] [--seconds 3] [--repeats 3]
                                [--page vllm|short]

Measurements in one run, each next to its baselines:

1. The hand-written parser against prometheus_client's text parser on the
   same bytes (a ~40 KB page generated with prometheus_client from vLLM's
   metric families, and the short sample vLLM's docs show), and ours on a
   busy pod's pages in turn.
2. The pool (discovery from a file, scrape rounds, parsing, snapshot swaps)
   against N loopback endpoints: CPU seconds used per wall second. The
   endpoints run in a child process (raw asyncio servers standing in for
   vLLM pods, answering with the page), so only the measuring process counts.
   The pool is measured with its rounds in a thread of the measuring process
   (``in_process``), with and without the family filter, and as ``policyd
   serve`` runs it by default, with the rounds in its scraper child process
   (whole page): the serving process's share (the rounds' results received,
   snapshots) and the child's, each per wall second and per round.
   Baselines on the same endpoints: the same rounds through an aiohttp
   ``ClientSession`` (GET + read, no parsing), the client the pool could have
   used; a bare asyncio protocol that only frames the responses, the floor
   any Python client on this event loop pays; and a bare ``selectors`` loop
   on one thread that sends each request and reads each answer into one
   buffer, framing it by Content-Length and nothing else: the system calls
   and the least Python the scraper child's own design pays. They are
   measured in turn, ``--repeats`` times over (the machine's load drifts),
   and the median of each is reported.

The goal is 100 pods at 10 Hz in at most a tenth of a core for both
processes together, as ``policyd serve`` runs by default (scraper child,
whole page).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import selectors
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from statistics import median

import aiohttp
from processes import process_cpu_seconds
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

from policyd.pool import MetricsParser, Pool, ScrapeConfig, StaticFileDiscovery
from policyd.pool.metric_names import VLLM

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

SHORT_SAMPLE = b"""\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-2-7b-hf"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-2-7b-hf"} 0.0
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-2-7b-hf"} 0.1234
vllm:kv_cache_usage_perc{model_name="meta-llama/Llama-2-7b-hf"} 0.1234
vllm:lora_requests_info{max_lora="4",running_lora_adapters="adapter-1,adapter-3",waiting_lora_adapters=""} 1.7327e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="adapter-1",waiting_lora_adapters="adapter-3"} 1.7327e+09
"""  # noqa: E501 - as vLLM prints it


def vllm_page() -> bytes:
    return generate_latest(vllm_registry())


def vllm_registry(load: tuple[int, int, float] = (7, 2, 0.42)) -> CollectorRegistry:
    """Metrics shaped like a busy vLLM server's: process and GC collectors
    first, then vLLM's gauges (``load``: running, waiting, KV-cache use),
    counters and histograms, with the LoRA info near the end (the parser's
    worst case)."""
    running, waiting, kv_cache = load
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    labels = ["model_name", "engine"]
    values = (MODEL, "0")
    for name, value in (
        ("num_requests_running", running),
        ("num_requests_waiting", waiting),
        ("kv_cache_usage_perc", kv_cache),
    ):
        Gauge(f"vllm:{name}", name, labels, registry=registry).labels(*values).set(value)
    for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens"):
        Counter(f"vllm:{name}", name, labels, registry=registry).labels(*values).inc(12345)
    success = Counter("vllm:request_success", "ok", [*labels, "finished_reason"], registry=registry)
    for reason in ("stop", "length", "abort"):
        success.labels(*values, reason).inc(100)
    token_buckets = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
    time_buckets = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
    for name, buckets in (
        ("iteration_tokens_total", token_buckets),
        ("request_prompt_tokens", token_buckets),
        ("request_generation_tokens", token_buckets),
        ("request_max_num_generation_tokens", token_buckets),
        ("request_params_n", [1, 2, 5, 10, 20]),
        ("request_params_max_tokens", token_buckets),
        ("time_to_first_token_seconds", time_buckets),
        ("time_per_output_token_seconds", time_buckets[:15]),
        ("e2e_request_latency_seconds", time_buckets),
        ("request_queue_time_seconds", time_buckets),
        ("request_inference_time_seconds", time_buckets),
        ("request_prefill_time_seconds", time_buckets),
        ("request_decode_time_seconds", time_buckets),
    ):
        histogram = Histogram(f"vllm:{name}", name, labels, buckets=buckets, registry=registry)
        for observation in (0.003, 0.3, 30, 300):
            histogram.labels(*values).observe(observation)
    lora = Gauge(
        "vllm:lora_requests_info",
        "lora",
        ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        registry=registry,
    )
    now = time.time()
    lora.labels("4", "adapter-1,adapter-3", "").set(now - 5)
    lora.labels("4", "adapter-1", "adapter-3").set(now - 1)
    lora.labels("4", "adapter-2,adapter-4", "adapter-1").set(now)
    info = Gauge(
        "vllm:cache_config_info",
        "cache config",
        ["block_size", "cache_dtype", "gpu_memory_utilization", "num_gpu_blocks", "prefix_cache"],
        registry=registry,
    )
    info.labels("16", "auto", "0.9", "27000", "True").set(1)
    return registry


# The endpoints, run in a child process: a prebuilt response per request.

SERVE_FLAG = "--serve-endpoints"


LOADS = ((7, 2, 0.42), (9, 0, 0.47), (6, 3, 0.40), (8, 1, 0.45))  # running, waiting, KV use


def serve_endpoints(count: int, page_kind: str) -> None:
    """Answers like prometheus_client's exposition: ``?name[]=`` picks families.

    A busy pod reports a new batch, queue and KV-cache use at nearly every
    scrape, so an endpoint answers its scrapes with the vLLM page at each of
    ``LOADS`` in turn: the pool then sees every pod change every round, as in
    service, and cannot keep last round's pods.
    """
    responses: dict[bytes, list[bytes]] = {}

    def page_at(load: tuple[int, int, float], names: list[str] | None) -> bytes:
        registry = vllm_registry(load)
        if names:
            return generate_latest(registry.restricted_registry(names))
        return generate_latest(registry)

    def responses_to(request_line: bytes) -> list[bytes]:
        target = request_line.split(b" ")[1]
        if target not in responses:
            _, _, query = target.decode().partition("?")
            names = urllib.parse.parse_qs(query).get("name[]")
            pages = (
                [SHORT_SAMPLE] if page_kind == "short" else [page_at(load, names) for load in LOADS]
            )
            responses[target] = [
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(page), page)
                for page in pages
            ]
        return responses[target]

    class Endpoint(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.transport = transport
            self.pending = b""
            self.answered = 0

        def data_received(self, data: bytes) -> None:
            self.pending += data
            while b"\r\n\r\n" in self.pending:
                request, self.pending = self.pending.split(b"\r\n\r\n", 1)
                answers = responses_to(request)
                self.transport.write(answers[self.answered % len(answers)])
                self.answered += 1

    async def main() -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(Endpoint, "127.0.0.1", 0) for _ in range(count)]
        ports = [server.sockets[0].getsockname()[1] for server in servers]
        print(" ".join(map(str, ports)), flush=True)
        await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes stdin

    asyncio.run(main())


# The measurements.


async def measure_pool(
    addresses: list[str], interval: float, seconds: float, *, filtered: bool, in_process: bool
) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as directory:
        pods = Path(directory) / "pods.yaml"
        pods.write_text(
            "pods:\n"
            + "".join(f"  - name: pod-{i}\n    address: {a}\n" for i, a in enumerate(addresses))
        )
        config = ScrapeConfig(interval=interval, filter_families=filtered, in_process=in_process)
        async with Pool(StaticFileDiscovery(pods), config) as pool:
            if not await pool.wait_ready(timeout=10):
                raise SystemExit("the pool did not become ready")
            await asyncio.sleep(interval * 5)  # warm connections
            child = getattr(pool._scraper, "pid", None)  # the scraper child, if any
            child_cpu = process_cpu_seconds(child) if child else 0.0
            rounds, cpu, wall = pool.rounds, time.process_time(), time.perf_counter()
            await asyncio.sleep(seconds)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            child_cpu = process_cpu_seconds(child) - child_cpu if child else 0.0
            snapshot = pool.snapshot()
            rounds_per_s = (pool.rounds - rounds) / wall
            return {
                "core": cpu / wall,
                "child_core": child_cpu / wall,
                "rounds_per_s": rounds_per_s,
                "candidates": len(snapshot.candidates),
                "overruns": pool.overruns,
            }


async def measure_aiohttp(addresses: list[str], interval: float, seconds: float) -> float:
    urls = [f"http://{address}/metrics" for address in addresses]
    timeout = aiohttp.ClientTimeout(total=5)  # generous: only its CPU cost is of interest
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def fetch(url: str) -> bytes:
            async with session.get(url) as response:
                return await response.read()

        loop = asyncio.get_running_loop()

        async def rounds(duration: float) -> None:
            due = loop.time()
            end = due + duration
            while loop.time() < end:
                await asyncio.gather(*(fetch(url) for url in urls))
                due += interval
                await asyncio.sleep(max(0.0, due - loop.time()))

        await rounds(interval * 5)
        cpu, wall = time.process_time(), time.perf_counter()
        await rounds(seconds)
        return (time.process_time() - cpu) / (time.perf_counter() - wall)


async def measure_floor(addresses: list[str], interval: float, seconds: float) -> float:
    """The least a Python asyncio client can do: write a request, count the bytes back."""
    loop = asyncio.get_running_loop()
    pending: list[asyncio.Future[None]] = []

    class Reader(asyncio.BufferedProtocol):
        def __init__(self) -> None:
            self.buffer = bytearray(1 << 16)
            self.filled = 0
            self.expected = -1

        def get_buffer(self, sizehint: int) -> memoryview:
            return memoryview(self.buffer)[self.filled :]

        def buffer_updated(self, nbytes: int) -> None:
            self.filled += nbytes
            if self.expected < 0:
                head_end = self.buffer.find(b"\r\n\r\n", 0, self.filled)
                if head_end < 0:
                    return
                field = self.buffer.find(b"Content-Length: ", 0, head_end) + 16
                length = int(self.buffer[field : self.buffer.find(b"\r\n", field, head_end + 2)])
                self.expected = head_end + 4 + length
            if self.filled >= self.expected:
                self.filled, self.expected = 0, -1
                done = pending[0]
                done.remaining -= 1  # type: ignore[attr-defined]
                if done.remaining == 0:  # type: ignore[attr-defined]
                    done.set_result(None)

    connections = []
    for address in addresses:
        host, port = address.rsplit(":", 1)
        transport, _ = await loop.create_connection(Reader, host, int(port))
        connections.append((transport, f"GET /metrics HTTP/1.1\r\nHost: {address}\r\n\r\n"))

    async def rounds(duration: float) -> None:
        due = loop.time()
        end = due + duration
        while loop.time() < end:
            done = loop.create_future()
            done.remaining = len(connections)  # type: ignore[attr-defined]
            pending[:] = [done]
            for transport, request in connections:
                transport.write(request.encode())
            await done
            due += interval
            await asyncio.sleep(max(0.0, due - loop.time()))

    await rounds(interval * 5)
    cpu, wall = time.process_time(), time.perf_counter()
    await rounds(seconds)
    core = (time.process_time() - cpu) / (time.perf_counter() - wall)
    for transport, _ in connections:
        transport.close()
    return core


def measure_selector_floor(addresses: list[str], interval: float, seconds: float) -> float:
    """CPU per wall second of rounds on a bare selector loop: send, read, frame by length."""
    selector = selectors.DefaultSelector()
    buffer = bytearray(256 * 1024)
    view = memoryview(buffer)
    sockets = []
    for address in addresses:
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        selector.register(sock, selectors.EVENT_READ, sock)
        sockets.append(sock)
    request = b"GET /metrics HTTP/1.1\r\nHost: policyd\r\n\r\n"

    def one_round() -> None:
        for sock in sockets:
            sock.send(request)
        missing: dict[socket.socket, int] = {}  # bytes still to come, for answers read in parts
        left = len(sockets)
        while left:
            for key, _ in selector.select(5.0):
                sock = key.data
                count = sock.recv_into(view)
                if sock in missing:
                    missing[sock] -= count
                else:
                    head_end = buffer.find(b"\r\n\r\n", 0, count)
                    field = buffer.find(b"Content-Length: ", 0, head_end) + 16
                    length = int(buffer[field : buffer.find(b"\r\n", field, head_end + 2)])
                    missing[sock] = head_end + 4 + length - count
                if missing[sock] == 0:
                    del missing[sock]
                    left -= 1

    def rounds(duration: float) -> None:
        due = time.monotonic()
        end = due + duration
        while time.monotonic() < end:
            one_round()
            due += interval
            time.sleep(max(0.0, due - time.monotonic()))

    try:
        rounds(interval * 5)
        cpu, wall = time.process_time(), time.perf_counter()
        rounds(seconds)
        return (time.process_time() - cpu) / (time.perf_counter() - wall)
    finally:
        for sock in sockets:
            sock.close()
        selector.close()


def per_call(function: object, argument: object, budget: float = 1.5) -> float:
    """Seconds per call, best of five batches within about ``budget`` seconds."""
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            function(argument)  # type: ignore[operator]
        if time.perf_counter() - start > budget / 10:
            break
        calls *= 2
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            function(argument)  # type: ignore[operator]
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def prometheus_client_parse(body: bytes) -> tuple[float, float, float]:
    """What reading the same values with prometheus_client's parser takes."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode("utf-8")):
        if family.name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                           "vllm:kv_cache_usage_perc", "vllm:lora_requests_info"):  # fmt: skip
            for sample in family.samples:
                found[family.name] = max(found.get(family.name, 0.0), sample.value)
    return (
        found["vllm:num_requests_waiting"],
        found["vllm:num_requests_running"],
        found["vllm:kv_cache_usage_perc"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page", choices=["vllm", "short"], default="vllm")
    parser.add_argument(SERVE_FLAG, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_endpoints:
        serve_endpoints(args.serve_endpoints, args.page)
        return

    page = vllm_page()
    ours = MetricsParser(VLLM)
    print("== parser: ours vs prometheus_client's text parser (same bytes, same run)")
    for label, body in (("vLLM page", page), ("short sample", SHORT_SAMPLE)):
        theirs = per_call(prometheus_client_parse, body)
        cold = per_call(ours.parse, body)
        print(
            f"{label:>13} ({len(body):>6} B): prometheus_client {theirs * 1e6:8.1f} us; "
            f"ours {cold * 1e6:6.1f} us ({theirs / cold:5.0f}x faster)"
        )
    # A busy pod's pages in turn, as the endpoints below answer: other values each time.
    pages = itertools.cycle([generate_latest(vllm_registry(load)) for load in LOADS])
    turn = per_call(lambda _: ours.parse(next(pages)), None)
    print(f"{'vLLM pages':>13} (4 loads in turn): ours {turn * 1e6:6.1f} us")

    child = subprocess.Popen(
        [sys.executable, __file__, SERVE_FLAG, str(args.pods), "--page", args.page],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        ports = child.stdout.readline().split()
        addresses = [f"127.0.0.1:{port}" for port in ports]
        rate = args.pods / args.interval
        size = len(page if args.page == "vllm" else SHORT_SAMPLE)
        print(
            f"== scraping {args.pods} loopback pods every {args.interval * 1000:.0f} ms "
            f"({rate:.0f} GET/s of {size} B); {args.repeats} x {args.seconds:.0f} s each, medians"
        )
        runs: dict[str, list[dict[str, float]]] = {"whole": [], "filtered": [], "child": []}
        aiohttp_runs: list[float] = []
        floor_runs: list[float] = []
        selector_runs: list[float] = []
        for _ in range(args.repeats):
            for kind in ("whole", "filtered", "child"):
                runs[kind].append(
                    asyncio.run(
                        measure_pool(
                            addresses,
                            args.interval,
                            args.seconds,
                            filtered=kind == "filtered",
                            in_process=kind != "child",
                        )
                    )
                )
            aiohttp_runs.append(
                asyncio.run(measure_aiohttp(addresses, args.interval, args.seconds))
            )
            floor_runs.append(asyncio.run(measure_floor(addresses, args.interval, args.seconds)))
            selector_runs.append(measure_selector_floor(addresses, args.interval, args.seconds))
        full, filtered, separate = (
            sorted(runs[kind], key=lambda run: run["core"])[len(runs[kind]) // 2]
            for kind in ("whole", "filtered", "child")
        )
        aiohttp_core, floor = median(aiohttp_runs), median(floor_runs)
        selector_floor = median(selector_runs)
        both = separate["core"] + separate["child_core"]
        for label, core in (
            ("pool in process, whole page (scrape+parse+snapshots)", full["core"]),
            ("aiohttp ClientSession, whole page (GET+read)", aiohttp_core),
            ("bare asyncio protocol, whole page (framing)", floor),
            ("bare selectors loop, whole page (framing)", selector_floor),
            ("pool in process, families asked for (name[]=)", filtered["core"]),
            ("pool with scraper child, whole page: serving process", separate["core"]),
            ("pool with scraper child, whole page: the child", separate["child_core"]),
        ):
            print(
                f"{label:>53}: {core:.3f} core, {core / rate * 1e6:4.0f} us CPU per scrape, "
                f"{core / (rate / args.pods) * 1e3:5.2f} ms per round"
            )
        print(
            f"whole page: pool / aiohttp {full['core'] / aiohttp_core:.2f}, "
            f"pool / bare protocol {full['core'] / floor:.2f}; "
            f"families asked for / whole page {filtered['core'] / full['core']:.2f}; "
            f"serving process with the scraper child / in process "
            f"{separate['core'] / full['core']:.2f}, "
            f"both processes / in process {both / full['core']:.2f}; "
            f"the scraper child / bare selectors loop {separate['child_core'] / selector_floor:.2f}"
        )
        for name, result in (
            ("in process, whole page", full),
            ("in process, families asked for", filtered),
            ("with scraper child, whole page", separate),
        ):
            print(
                f"pool, {name}: {result['rounds_per_s']:.1f} rounds/s, "
                f"{result['candidates']:.0f} candidates, {result['overruns']:.0f} overruns"
            )
        verdict = "met" if both <= 0.1 else "NOT met"
        print(
            f"goal, as policyd serve runs it (scraper child, whole page as vLLM sends it), "
            f"both processes: at most a tenth of a core (<= 0.1): {both:.3f} -> {verdict}"
        )
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=10)


if __name__ == "__main__":
    main()
