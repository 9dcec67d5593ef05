"""What putting policyd in Envoy's request path costs, measured through the real Envoy.

    python benchmarks/overhead.py [--requests 400] [--seconds 4] [--concurrency 16]

Three set-ups on loopback, measured in the same run:

  (a) Envoy straight to a pod (no ext_proc filter; the client names the pod),
  (b) Envoy + a no-op Python ext_proc written here (continues every phase and
      names a fixed pod: the floor for any Python ext_proc),
  (c) Envoy + policyd's ext_proc server (full request parsing, reply building,
      usage reading) with a pick-first router over one pod.

For each: latency p50/p99 at concurrency 1, then throughput at
``--concurrency``, in rounds that visit the three set-ups in turn. Printed
as differences and ratios against the previous set-up, since these shared
machines drift. The pod is a minimal aiohttp server in its own process;
each ext_proc server and Envoy (``--concurrency 1``) run in their own
processes too. (c) does not yet run the real policy over 100 simulated pods'
metrics: that needs the policy engine and the simulator and is for
``policyd serve`` to plug in.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import multiprocessing
import socket
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from policyd.extproc import replies
from policyd.extproc.envoy_config import EnvoyConfigOptions, bootstrap
from policyd.extproc.envoy_process import EnvoyProcess
from policyd.extproc.server import ExtProcServer, ServerOptions
from policyd.policy.decision import Decision, Outcome
from policyd.policy.request import Request
from policyd.pool.pod import Pod

BODY = (
    b'{"model": "llama-3-8b", "prompt": "Summarise the following text in one sentence: '
    + b"lorem ipsum " * 16
    + b'", "max_tokens": 16}'
)
ANSWER = {
    "id": "cmpl-1",
    "object": "text_completion",
    "choices": [{"text": "ok"}],
    "usage": {"prompt_tokens": 60, "completion_tokens": 1},
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port} after {timeout}s")


# -- processes ----------------------------------------------------------------------------


def run_pod(port: int) -> None:
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(ANSWER)

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


class FixedDestination(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The no-op ext_proc: no parsing, no policy; every request goes to one pod."""

    def __init__(self, destination: str) -> None:
        self.routed = replies.RouteReplies().route(destination)

    async def Process(  # noqa: N802
        self, requests: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in requests:
            phase = message.WhichOneof("request")
            if phase == "request_headers":
                yield replies.REQUEST_HEADERS_CONTINUE
            elif phase == "request_body":
                yield self.routed
            elif phase == "response_headers":
                yield replies.RESPONSE_HEADERS_CONTINUE
            else:
                yield replies.RESPONSE_BODY_CONTINUE


def run_noop_extproc(port: int, destination: str) -> None:
    async def serve() -> None:
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(FixedDestination(destination), server)
        health_servicer = health.aio.HealthServicer()  # Envoy health-checks "readiness"
        await health_servicer.set("readiness", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


class PickFirst:
    def decide(self, request: Request, candidates: Sequence[Pod]) -> Decision:
        pod = candidates[0]
        return Decision(Outcome.ROUTED, "bench", "1", request.model, pod.address, pod.name)


@dataclasses.dataclass(frozen=True)
class OnePod:
    candidates: tuple[Pod, ...]


def run_policyd(port: int, destination: str) -> None:
    router, snapshot = PickFirst(), OnePod((Pod("pod-0", destination),))
    server = ExtProcServer(
        lambda: router, lambda: snapshot, options=ServerOptions(port=port, grace_seconds=0)
    )
    asyncio.run(server.run_until_signalled())


# -- measuring ----------------------------------------------------------------------------


@dataclasses.dataclass
class SetUp:
    """One Envoy configuration under test, with its own client session."""

    name: str
    url: str
    headers: dict[str, str]
    envoy: EnvoyProcess
    session: aiohttp.ClientSession | None = None
    latencies_ms: list[float] = dataclasses.field(default_factory=list)
    completed: int = 0
    busy_seconds: float = 0.0

    async def one(self) -> None:
        assert self.session is not None
        async with self.session.post(self.url, data=BODY, headers=self.headers) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"{self.name}: status {response.status}")

    async def sequential(self, count: int) -> None:
        for _ in range(count):
            started = time.perf_counter()
            await self.one()
            self.latencies_ms.append((time.perf_counter() - started) * 1000)

    async def saturate(self, seconds: float, concurrency: int) -> None:
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                await self.one()
                self.completed += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        self.busy_seconds += time.perf_counter() - started

    def figures(self) -> tuple[float, float, float]:
        p99 = statistics.quantiles(self.latencies_ms, n=100)[98]
        return statistics.median(self.latencies_ms), p99, self.completed / self.busy_seconds


def start_envoy(name: str, directory: Path, extproc_port: int | None, pod: str) -> SetUp:
    listen, admin = free_port(), free_port()
    options = EnvoyConfigOptions(port=listen, admin_port=admin, policyd_port=extproc_port or 1)
    config = bootstrap(options)
    headers = {"content-type": "application/json"}
    if extproc_port is None:  # (a): no ext_proc filter; the client names the pod itself
        manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        filters = manager["typed_config"]["http_filters"]
        filters[:] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
        headers[replies.DESTINATION_HEADER] = pod
    path = directory / f"{name[1]}.yaml"
    path.write_text(yaml.safe_dump(config))
    envoy = EnvoyProcess(path, admin, log_file=directory / f"{name[1]}.log")
    envoy.start()
    return SetUp(name, f"http://127.0.0.1:{listen}/v1/completions", headers, envoy)


async def measure(set_ups: list[SetUp], arguments: argparse.Namespace) -> None:
    """Rounds that visit every set-up in turn, so drift on a shared machine hits all alike."""
    for set_up in set_ups:
        await set_up.envoy.wait_ready()
        connector = aiohttp.TCPConnector(limit=arguments.concurrency)
        set_up.session = aiohttp.ClientSession(connector=connector)
        for _ in range(50):  # warm up connections and code paths
            await set_up.one()
    rounds = arguments.rounds
    for _ in range(rounds):
        for set_up in set_ups:
            await set_up.sequential(arguments.requests // rounds)
    for _ in range(rounds):
        for set_up in set_ups:
            await set_up.saturate(arguments.seconds / rounds, arguments.concurrency)


async def main(arguments: argparse.Namespace) -> None:
    context = multiprocessing.get_context("spawn")
    pod_port, noop_port, policyd_port = free_port(), free_port(), free_port()
    pod = f"127.0.0.1:{pod_port}"
    processes = [
        context.Process(target=run_pod, args=(pod_port,), daemon=True),
        context.Process(target=run_noop_extproc, args=(noop_port, pod), daemon=True),
        context.Process(target=run_policyd, args=(policyd_port, pod), daemon=True),
    ]
    for process in processes:
        process.start()
    try:
        for port in (pod_port, noop_port, policyd_port):
            wait_for_port(port)
        with tempfile.TemporaryDirectory(prefix="policyd-bench-") as temporary:
            directory = Path(temporary)
            set_ups = [
                start_envoy("(a) envoy -> pod", directory, None, pod),
                start_envoy("(b) + no-op ext_proc", directory, noop_port, pod),
                start_envoy("(c) + policyd ext_proc", directory, policyd_port, pod),
            ]
            try:
                await measure(set_ups, arguments)
            finally:
                for set_up in set_ups:
                    if set_up.session is not None:
                        await set_up.session.close()
                    set_up.envoy.stop()
    finally:
        for process in processes:
            process.terminate()
            process.join(5)
    print(f"{'set-up':<26}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}")
    results = {set_up.name[1]: set_up.figures() for set_up in set_ups}
    for set_up in set_ups:
        p50, p99, rps = results[set_up.name[1]]
        print(f"{set_up.name:<26}{p50:>9.3f}{p99:>9.3f}{rps:>9.0f}")
    for label, base, more in (
        ("ext_proc floor (b)-(a)", "a", "b"),
        ("policyd extra  (c)-(b)", "b", "c"),
    ):
        (base_p50, _, base_rps), (p50, _, rps) = results[base], results[more]
        print(f"{label}: p50 {p50 - base_p50:+.3f} ms, req/s x{rps / base_rps:.2f}")
    print("goals: (c) - (b) p50 <= +0.5 ms; (c) req/s >= 0.85 x (b)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="sequential requests per set-up")
    parser.add_argument("--seconds", type=float, default=4.0, help="throughput phase per set-up")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds per phase")
    asyncio.run(main(parser.parse_args()))
