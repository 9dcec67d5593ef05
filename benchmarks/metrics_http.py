"""The monitoring endpoint's cost: policyd's own HTTP server against aiohttp's, same run.

``policyd/telemetry/http.py`` serves ``/metrics``, ``/healthz`` and ``/readyz``
with a small HTTP/1.1 server of its own, although aiohttp, a runtime
dependency, has one. This measures what each costs the serving process: both
serve the same registry from a thread of their own with their own event loop
(as ``policyd serve`` runs the endpoint beside the serving loop, sharing its
GIL), in this process, at once; a client in another process keeps
``--concurrency`` keep-alive connections busy against one of them at a time,
for ``--seconds``, alternating the two over ``--rounds`` (the order swapped
each round). The figure is the CPU time of the serving thread (from
``/proc/self/task``) per request: a scrape of the registry (a pool of
``--pods`` pods, shaped as policyd's per-pod gauges and a decision histogram),
and a liveness probe.

    python benchmarks/metrics_http.py                    # 5 rounds of 3 s per load and server
    python benchmarks/metrics_http.py --rounds 1 --seconds 1   # a quick look

Figures and the decision they support: benchmarks/RESULTS.md, "Monitoring endpoint".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import multiprocessing.queues
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from policyd.telemetry.http import start_metrics_server

LOADS = {"scrape": "/metrics", "probe": "/healthz"}


def pool_registry(pods: int) -> CollectorRegistry:
    """A registry shaped like a serving process's: per-pod gauges, routed counts, latencies."""
    registry = CollectorRegistry()
    gauges = [
        Gauge(f"bench_pod_{name}", name, ["pod", "address"], registry=registry)
        for name in ("waiting", "running", "kv_cache", "in_flight", "metrics_age", "preemptions")
    ]
    routed = Counter("bench_decisions", "routed", ["policy", "outcome", "pod"], registry=registry)
    latency = Histogram("bench_decision_seconds", "decision time", ["policy"], registry=registry)
    for index in range(pods):
        name, address = f"vllm-{index}", f"10.0.{index // 250}.{index % 250}:8000"
        for gauge in gauges:
            gauge.labels(name, address).set(index * 0.5)
        routed.labels("default", "routed", name).inc(index)
    for index in range(1000):
        latency.labels("default").observe(index * 1e-6)
    return registry


class AiohttpEndpoint:
    """The same three endpoints with aiohttp's server, on a thread and loop of its own."""

    def __init__(self, registry: CollectorRegistry, ready: Callable[[], bool]) -> None:
        self.registry = registry
        self.ready = ready
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, name="aiohttp-metrics", daemon=True)
        self.thread.start()
        self._started.wait()

    async def _metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self.registry), headers={"Content-Type": content_type})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        ready = self.ready()
        return web.Response(status=200 if ready else 503, text="ready\n" if ready else "not\n")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        server = site._server
        assert isinstance(server, asyncio.Server)
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self.thread.join(timeout=5)


def thread_cpu_seconds(native_id: int | None) -> float:
    """User + system CPU seconds of one thread of this process so far (Linux /proc)."""
    stat = Path(f"/proc/self/task/{native_id}/stat").read_text()
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client(
    url: str, concurrency: int, seconds: float, done: multiprocessing.queues.Queue[Any]
) -> None:
    """Keeps ``concurrency`` keep-alive connections asking ``url`` for ``seconds``."""

    async def run() -> int:
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            deadline = time.perf_counter() + seconds
            counts = [0] * concurrency

            async def worker(slot: int) -> None:
                while time.perf_counter() < deadline:
                    async with session.get(url) as response:
                        await response.read()
                        if response.status != 200:
                            raise RuntimeError(f"{url} answered {response.status}")
                    counts[slot] += 1

            await asyncio.gather(*(worker(slot) for slot in range(concurrency)))
            return sum(counts)

    done.put(asyncio.run(run()))


def measure(
    context: Any, port: int, thread: int | None, path: str, arguments: argparse.Namespace
) -> float:
    """Serving-thread CPU microseconds per request over one client run."""
    done: multiprocessing.queues.Queue[Any] = context.Queue()
    url = f"http://127.0.0.1:{port}{path}"
    process = context.Process(target=client, args=(url, arguments.concurrency, 0.3, done))
    process.start()  # a warm-up: connections open, the client's imports loaded
    done.get()
    process.join()
    process = context.Process(
        target=client, args=(url, arguments.concurrency, arguments.seconds, done)
    )
    before = thread_cpu_seconds(thread)
    process.start()
    requests = done.get()
    process.join()
    return (thread_cpu_seconds(thread) - before) / requests * 1e6


def slow_clients(port: int, count: int, seconds: float) -> int:
    """Of ``count`` connections each sending a request head a byte every half second (a
    slow loris), how many the server still holds open after ``seconds``."""
    connections = []
    for _ in range(count):
        with_server = socket.create_connection(("127.0.0.1", port))
        with_server.setblocking(False)
        connections.append(with_server)
    head = b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 10_000
    deadline = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < deadline:
        for connection in connections:
            with contextlib.suppress(OSError):  # closed by the server: counted below
                connection.send(head[sent : sent + 1])
        sent += 1
        time.sleep(0.5)
    held = 0
    for connection in connections:
        try:
            held += connection.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            held += 1  # nothing to read and not closed: still open
        except OSError:
            pass  # reset by the server
        connection.close()
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=100, help="pods in the scraped registry")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="per load, server and round")
    parser.add_argument("--concurrency", type=int, default=4, help="client connections")
    parser.add_argument("--slow", type=int, default=200, help="slow-loris connections")
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=2.0,
        help="policyd's server's read timeout for the run (shipped: 10 s); the slow clients "
        "dribble for twice as long",
    )
    arguments = parser.parse_args()
    registry = pool_registry(arguments.pods)
    own = start_metrics_server(
        "127.0.0.1", 0, registry, ready=lambda: True, read_timeout=arguments.read_timeout
    )
    theirs = AiohttpEndpoint(registry, lambda: True)
    servers = {
        "policyd's": (own.port, own._thread.native_id),
        "aiohttp's": (theirs.port, theirs.thread.native_id),
    }
    context = multiprocessing.get_context("spawn")
    figures: dict[tuple[str, str], list[float]] = {}
    size = len(choose_encoder("")[0](registry))
    try:
        for round_ in range(arguments.rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for load, path in LOADS.items():
                for name in order:
                    port, thread = servers[name]
                    cost = measure(context, port, thread, path, arguments)
                    figures.setdefault((load, name), []).append(cost)
        held = {
            name: slow_clients(port, arguments.slow, 2 * arguments.read_timeout)
            for name, (port, _) in servers.items()
        }
    finally:
        own.close()
        theirs.close()
    print(
        f"monitoring endpoint: {arguments.rounds} rounds of {arguments.seconds:g} s per load "
        f"and server, {arguments.concurrency} keep-alive connections; /metrics is "
        f"{size / 1024:.0f} KiB ({arguments.pods} pods)"
    )
    print(f"{'load':<8} {'server':<10} {'CPU us/request':>14} {'min-max':>13} {'vs policyd':>10}")
    for load in LOADS:
        reference = statistics.median(figures[(load, "policyd's")])
        for name in servers:
            values = figures[(load, name)]
            median = statistics.median(values)
            spread = f"{min(values):.0f}-{max(values):.0f}"
            print(f"{load:<8} {name:<10} {median:>14.0f} {spread:>13} {median / reference:>9.2f}x")
    print(
        f"{arguments.slow} slow-loris connections, after {2 * arguments.read_timeout:g} s: "
        + ", ".join(f"{name} server holds {count}" for name, count in held.items())
        + f" (policyd's: at most {own.max_connections} open, each closed at its "
        f"{arguments.read_timeout:g} s read timeout)"
    )


if __name__ == "__main__":
    main()
