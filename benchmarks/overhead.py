"""What putting policyd in Envoy's request path costs, measured through the real Envoy.

    python benchmarks/overhead.py [--requests 1200] [--seconds 6] [--concurrency 16,64,128]
                                  [--pods 100] [--naive] [--pick-first] [--tracing]
                                  [--sample-ratio R] [--scrape-in-process] [--profile FILE]
                                  [--versus TREE] [--sample FILE]

Set-ups on loopback, measured in the same run:

  (a) Envoy straight to a pod (no ext_proc filter; the client names the pod),
  (b) Envoy + a no-op Python ext_proc written here (continues every phase and
      names a fixed pod: the floor for any Python ext_proc),
  (c) Envoy + policyd as ``policyd serve`` runs it (the ``Policyd`` service:
      ``rules/default.yaml`` through the real PolicyStore and Router, the pool
      built from ``policyd serve``'s own flags and defaults, scraping
      ``--pods`` endpoints' vLLM metrics every 100 ms in its scraper child
      process, request parsing, replies, usage reading, its Prometheus
      metrics; tracing off), routing each request to one of them;
      ``--scrape-in-process`` scrapes on policyd's serving
      loop instead (``policyd serve --scrape-in-process``),
  (b') with ``--naive``: a naive routing ext_proc written here, the least
      Python that does policyd's job without a policy engine: request
      headers into a dict, the body through ``json.loads`` for its model, a
      pod picked by the model's hash, the routing reply built as a message
      (header, ``envoy.lb`` metadata, route cache cleared), the status read
      from the response headers and the usage from the response body with
      ``json.loads``: the floor for a Python ext_proc that routes on the
      request and reports how it went,
  (c') with ``--pick-first``: policyd's serving path with a pick-first router
      over one pod and no pool, to tell the policy's share from the serving
      path's,
  (d) with ``--tracing``: (c) with tracing on, as ``policyd serve
      --otlp-endpoint`` runs it: a span per decision, sampled always (Envoy
      sends no trace context here, so every span is a root), exported over
      OTLP/gRPC by the SDK's batch processor to a collector stand-in run here
      that counts them on the wire and keeps nothing,
  (d') with ``--tracing --sample-ratio R``: (d) with one request in 1/R
      recorded (``OTEL_TRACES_SAMPLER=parentbased_traceidratio``,
      ``OTEL_TRACES_SAMPLER_ARG=R``), as docs/observability.md recommends for
      production; the others still get their ``traceparent``. The goal
      (issue 24) is (d') >= 0.85 x (c) in throughput; (d) at 100% is
      recorded,
  (v) with ``--versus TREE``: (c) as another checkout of policyd runs it
      (``TREE/.venv``, from its own ``make install``; ``TREE``'s
      ``run_policyd`` in ``TREE``'s Python, behind an Envoy from ``TREE``'s
      own bootstrap), for a same-run A/B of two commits: each round
      measures (c) and (v) back to back, in alternating order, and the
      report gives their ratio of CPU per request (serving process plus
      scraper) round by round, the median and the range.

For each: latency p50/p99 at concurrency 1, then throughput at each of the
``--concurrency`` levels, in rounds that visit the set-ups in turn. A set-up's
max throughput is its best over those levels: the no-op keeps gaining past
concurrency 16 on these machines (gRPC handles more messages per wake-up),
so a single level of 16 flattered policyd's share. (Past 128, the pods
process, which serves every pod's metrics and the completions in one Python
process, falls behind on the 2-core VMs and whole scrape rounds time out; policyd
then routes on metrics up to ``--stale-after`` old, docs/pool.md "Panic",
and answers 503 once they are all older.) Answers other than 200 in the
throughput phases are counted apart, printed, and left out of the
throughput; in the latency phase and the warm-up they stop the run.
Printed as differences and ratios against (b), since these shared machines
drift, with the ratio at each level as well.

The pods are ``--pods`` minimal HTTP endpoints in one process of their own:
each serves a ~38 KB vLLM-shaped metrics page with its own LoRA adapters
and a queue, batch and KV-cache use that change at every scrape (ignoring
the ``name[]=`` filter, as vLLM does) and answers
completions at once with a fixed JSON body. (a) and (b) send to the first of
them. Each ext_proc server and Envoy (``--concurrency 1``) run in their own
processes too; policyd scrapes all through the run, as it would in service,
so its scraping is background load for every set-up and, with
``--scrape-in-process``, in-loop work for (c). The ext_proc CPU column is the
serving process's; the scraper child's CPU is printed after the table.
``--profile FILE`` writes a cProfile of policyd's serving thread (pstats
format), and of (d)'s to ``FILE.d``; the span exporter's thread is not in it.
``--sample FILE`` samples (c)'s processes (the serving process and its
scraper) with py-spy all through the run instead (``FILE``, collapsed
stacks; (v)'s to ``FILE.v``) and prints where the samples that were not
waiting fell: gRPC's C, policyd's Python, asyncio's, the scraper. A sampled
run's CPU figures include py-spy's pauses: measure without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import json
import multiprocessing
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp

from policyd.cli import build_parser
from policyd.extproc import replies
from policyd.extproc.assembly import Policyd
from policyd.extproc.envoy_config import EnvoyConfigOptions, bootstrap
from policyd.extproc.envoy_process import EnvoyProcess, free_port
from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.extproc.serve_command import freeze_startup_heap
from policyd.policy import PolicyStore
from policyd.policy.decision import Decision, Outcome
from policyd.policy.request import Request
from policyd.pool.options import pool_from_arguments
from policyd.pool.pod import Pod
from policyd.telemetry import build_telemetry

sys.path.insert(0, str(Path(__file__).parent))
from processes import (
    children_cpu_seconds,
    machine_busy_seconds,
    process_cpu_seconds,
    wait_for_port,
)
from scrape import vllm_page  # the scrape benchmark's vLLM-shaped page

REPO = Path(__file__).resolve().parents[1]
BODY = (
    b'{"model": "adapter-3", "prompt": "Summarise the following text in one sentence: '
    + b"lorem ipsum " * 16
    + b'", "max_tokens": 16}'
)
CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)")
ANSWER = (
    b'{"id":"cmpl-1","object":"text_completion","choices":[{"text":"ok"}],'
    b'"usage":{"prompt_tokens":60,"completion_tokens":1}}'
)


# -- the pods: metrics pages and completions, in one process -------------------------------


PAGE_VARIANTS = 4


def pod_pages(template: str, index: int) -> list[bytes]:
    """This pod's vLLM-shaped pages: its adapters, and a load that moves between scrapes.

    A pod under load reports a new queue, batch and KV-cache use at nearly
    every scrape, so each GET answers the next of ``PAGE_VARIANTS`` pages
    with different values: policyd's pool then builds new pods and its
    router new walks each round, as it does in service, not only once.
    """
    rng = random.Random(index)
    adapters = ",".join(f"adapter-{i}" for i in rng.sample(range(12), rng.randint(0, 4)))
    pages = []
    for _ in range(PAGE_VARIANTS):
        values = {
            "vllm:num_requests_running": rng.randint(0, 12),
            "vllm:num_requests_waiting": rng.choice((0, 0, 1, 3)),
            "vllm:kv_cache_usage_perc": round(rng.uniform(0.05, 0.75), 3),
        }
        page = template
        for name, value in values.items():
            page = re.sub(
                rf"^({re.escape(name)}\{{[^}}]*\}}) \S+$", rf"\g<1> {value}", page, flags=re.M
            )
        page = page.replace(
            'running_lora_adapters="adapter-2,adapter-4"', f'running_lora_adapters="{adapters}"'
        )
        pages.append(page.encode())
    return pages


def http_response(body: bytes, content_type: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
        content_type,
        len(body),
        body,
    )


class PodEndpoint(asyncio.Protocol):
    """HTTP/1.1 keep-alive: GET -> the next metrics page, POST -> the completion answer."""

    def __init__(self, metrics: list[bytes]) -> None:
        self.metrics = metrics
        self.scrapes = 0
        self.answer = http_response(ANSWER, b"application/json")
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (head_end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:head_end].lower()
            match = CONTENT_LENGTH.search(head)
            end = head_end + 4 + (int(match.group(1)) if match else 0)
            if len(self.buffer) < end:
                return
            self.buffer = self.buffer[end:]
            if head.startswith(b"get"):
                self.scrapes += 1
                self.transport.write(self.metrics[self.scrapes % len(self.metrics)])
            else:
                self.transport.write(self.answer)


def write_pods_file(path: Path, addresses: Sequence[str]) -> Path:
    """``path`` written as the pods file ``policyd serve --pods`` reads: pod ``i`` is
    ``vllm-{i}`` at ``addresses[i]``."""
    path.write_text(
        "pods:\n"
        + "".join(f"  - {{name: vllm-{i}, address: '{a}'}}\n" for i, a in enumerate(addresses))
    )
    return path


def run_pods(count: int, ports: Any) -> None:
    """Serve ``count`` pods on free ports; their ports go back through ``ports`` (a queue)."""

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        template = vllm_page().decode()
        servers = []
        for index in range(count):
            metrics = [
                http_response(page, b"text/plain; version=0.0.4")
                for page in pod_pages(template, index)
            ]
            servers.append(
                await loop.create_server(lambda m=metrics: PodEndpoint(m), "127.0.0.1", 0)
            )
        ports.put([server.sockets[0].getsockname()[1] for server in servers])
        await asyncio.Event().wait()

    asyncio.run(serve())


# -- the ext_proc servers ------------------------------------------------------------------


class FixedDestination(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The no-op ext_proc: no parsing, no policy; every request goes to one pod.

    A plain servicer: it answers with policyd's replies as messages, which gRPC
    serializes per reply (policyd sends them pre-encoded).
    """

    def __init__(self, destination: str) -> None:
        parse = pb.ProcessingResponse.FromString
        self.answers = {
            "request_headers": parse(replies.REQUEST_HEADERS_CONTINUE),
            "request_body": parse(replies.RouteReplies().route(destination)),
            "response_headers": parse(replies.RESPONSE_HEADERS_CONTINUE),
            "response_body": parse(replies.RESPONSE_BODY_CONTINUE),
        }

    async def Process(  # noqa: N802
        self, requests: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        answers = self.answers
        async for message in requests:
            yield answers[message.WhichOneof("request")]


def run_noop_extproc(port: int, destination: str) -> None:
    serve_servicer(port, FixedDestination(destination))


def serve_servicer(port: int, servicer: pb_grpc.ExternalProcessorServicer) -> None:
    """Serve a plain ``ExternalProcessor`` servicer on ``port``, with gRPC health."""

    async def serve() -> None:
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()  # Envoy health-checks "readiness"
        await health_servicer.set("readiness", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


class NaiveRouter(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """(b'): routes on the request's model and reads the usage, as a plain servicer would.

    Nothing policyd does to save work (pre-encoded replies, its own JSON
    scan, lazy headers) is used; everything a routing ext_proc cannot skip is
    done: the headers are read, the body parsed, the reply carries the
    destination the DESIGN wire facts ask for, and the usage is read.
    """

    def __init__(self, pods: Sequence[str]) -> None:
        self.pods = list(pods)
        self.usage: dict[str, int] = {}  # the last usage read, so the work is not dead
        self.continue_headers = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        self.continue_response_headers = pb.ProcessingResponse(
            response_headers=pb.HeadersResponse()
        )
        self.continue_response_body = pb.ProcessingResponse(response_body=pb.BodyResponse())

    def route(self, destination: str) -> pb.ProcessingResponse:
        reply = pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    header_mutation=pb.HeaderMutation(
                        set_headers=[
                            base_pb2.HeaderValueOption(
                                header=base_pb2.HeaderValue(
                                    key=replies.DESTINATION_HEADER,
                                    raw_value=destination.encode(),
                                ),
                                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                            )
                        ]
                    ),
                    clear_route_cache=True,
                )
            )
        )
        lb = reply.dynamic_metadata.fields[replies.LB_METADATA_NAMESPACE].struct_value
        lb.fields[replies.DESTINATION_HEADER].string_value = destination
        return reply

    async def Process(  # noqa: N802
        self, requests: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = NaiveExchange(self)
        async for message in requests:
            yield exchange.handle(message)


class NaiveExchange:
    """One request's messages through :class:`NaiveRouter` (``cold_cache.py`` times it too)."""

    def __init__(self, router: NaiveRouter) -> None:
        self.router = router
        self.headers: dict[str, str] = {}
        self.status = 0

    def handle(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse:
        router = self.router
        phase = message.WhichOneof("request")
        if phase == "request_headers":
            for header in message.request_headers.headers.headers:
                self.headers[header.key] = header.raw_value.decode()
            return router.continue_headers
        if phase == "request_body":
            model = json.loads(message.request_body.body)["model"]
            return router.route(router.pods[hash(model) % len(router.pods)])
        if phase == "response_headers":
            for header in message.response_headers.headers.headers:
                if header.key == ":status":
                    self.status = int(header.raw_value)
            return router.continue_response_headers
        body = message.response_body
        if body.end_of_stream and self.status == 200:
            router.usage = json.loads(body.body).get("usage") or {}
        return router.continue_response_body


def run_naive_extproc(port: int, pods: Sequence[str]) -> None:
    serve_servicer(port, NaiveRouter(pods))


def run_policyd(  # noqa: PLR0917  (a multiprocessing target: positional arguments)
    port: int,
    pods_file: str,
    profile: str,
    scrape_in_process: bool,
    otlp_endpoint: str = "",
    sample_ratio: float | None = None,
) -> None:
    """policyd as ``policyd serve --policy rules/default.yaml --pods FILE`` runs it:
    its pool from ``policyd serve``'s own flags and defaults, its Prometheus
    metrics (on by default), and with ``otlp_endpoint`` its spans to that
    collector (``--otlp-endpoint``), sampled at ``sample_ratio`` if given."""
    if sample_ratio is not None:  # this process only (spawned): the SDK reads these
        os.environ["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
        os.environ["OTEL_TRACES_SAMPLER_ARG"] = str(sample_ratio)
    policy = REPO / "rules" / "default.yaml"
    argv = ["serve", "--policy", str(policy), "--pods", pods_file]
    if scrape_in_process:
        argv.append("--scrape-in-process")
    arguments = build_parser("serve").parse_args(argv)

    async def serve() -> None:
        telemetry = build_telemetry(tracing=bool(otlp_endpoint), otlp_endpoint=otlp_endpoint)
        service = Policyd(
            PolicyStore.open(arguments.policy),
            pool_from_arguments(arguments),
            ServerOptions(port=port, grace_seconds=0),
            telemetry=telemetry,
        )
        freeze_startup_heap()  # as policyd serve does before it starts serving
        try:
            await service.run_until_signalled()
        finally:
            telemetry.shutdown()

    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    try:
        asyncio.run(serve())
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)


def count_spans(request: bytes) -> int:
    """The spans in an encoded ``ExportTraceServiceRequest``, counted on the wire.

    The collector stand-in shares the benchmark's two cores with everything it
    measures, while a real collector runs elsewhere: parsing every span (as
    the generated message class does) would cost it about as much as the
    tracing being measured. Walking three levels of field headers costs it
    next to nothing.
    """
    count = 0
    for field, resource_spans in _fields(request):  # ExportTraceServiceRequest
        if field == 1:  # resource_spans
            for inner, scope_spans in _fields(resource_spans):  # ResourceSpans
                if inner == 2:  # scope_spans
                    count += sum(1 for number, _ in _fields(scope_spans) if number == 2)  # spans
    return count


def _fields(data: bytes | memoryview) -> Iterator[tuple[int, memoryview]]:
    """Each field's number, with its payload when length-delimited (else empty)."""
    view = memoryview(data)
    at = 0
    while at < len(view):
        key, at = _varint(view, at)
        wire = key & 7
        if wire == 2:
            size, at = _varint(view, at)
            yield key >> 3, view[at : at + size]
            at += size
            continue
        if wire == 0:
            _, at = _varint(view, at)
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire} in an OTLP request")
        yield key >> 3, view[at:at]


def _varint(view: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = view[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def run_collector(port: int, spans: Any) -> None:
    """The collector stand-in: takes every OTLP export as bytes, counts its spans."""

    async def export(request: bytes, context: Any) -> otlp.ExportTraceServiceResponse:
        count = count_spans(request)
        with spans.get_lock():
            spans.value += count
        return otlp.ExportTraceServiceResponse()

    async def serve() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(
            export,
            request_deserializer=None,  # the request's bytes, not parsed
            response_serializer=otlp.ExportTraceServiceResponse.SerializeToString,
        )
        service = otlp.DESCRIPTOR.services_by_name["TraceService"].full_name
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"Export": handler}),)
        )
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


def run_pick_first(port: int, destination: str) -> None:
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
    extproc_pid: int | None = None  # the ext_proc server's process, if any
    latencies_ms: list[float] = dataclasses.field(default_factory=list)
    loads: dict[int, Load] = dataclasses.field(default_factory=dict)  # by concurrency

    async def one(self) -> int:
        """One request; its status."""
        assert self.session is not None
        async with self.session.post(self.url, data=BODY, headers=self.headers) as response:
            await response.read()
            return response.status

    async def one_ok(self) -> None:
        if (status := await self.one()) != 200:
            raise RuntimeError(f"{self.name}: status {status}")

    async def sequential(self, count: int) -> None:
        for _ in range(count):
            started = time.perf_counter()
            await self.one_ok()
            self.latencies_ms.append((time.perf_counter() - started) * 1000)

    async def saturate(self, seconds: float, concurrency: int) -> None:
        deadline = time.perf_counter() + seconds
        load = self.loads.setdefault(concurrency, Load())

        async def worker() -> None:
            while time.perf_counter() < deadline:
                if await self.one() == 200:
                    load.completed += 1
                else:  # counted, not served: an error answer must not pass for throughput
                    load.failed += 1

        pid = self.extproc_pid
        cpu = process_cpu_seconds(pid) if pid else 0.0
        children = children_cpu_seconds(pid) if pid else {}
        assert self.envoy.process is not None
        envoy_pid = self.envoy.process.pid
        machine, envoy, client = (
            machine_busy_seconds(),
            process_cpu_seconds(envoy_pid),
            time.process_time(),
        )
        completed_before = load.completed
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        load.busy_seconds += time.perf_counter() - started
        load.machine_busy_seconds += machine_busy_seconds() - machine
        load.envoy_cpu_seconds += process_cpu_seconds(envoy_pid) - envoy
        load.client_cpu_seconds += time.process_time() - client
        if pid:
            serving = process_cpu_seconds(pid) - cpu
            after = children_cpu_seconds(pid)
            scraping = sum(
                after[child] - children[child] for child in after.keys() & children.keys()
            )
            load.extproc_cpu_seconds += serving
            load.children_cpu_seconds += scraping
            load.phases.append(Phase(load.completed - completed_before, serving + scraping))

    def rate(self, concurrency: int) -> float:
        """Requests per second at ``concurrency``."""
        return self.loads[concurrency].requests_per_second

    @property
    def peak(self) -> tuple[int, Load]:
        """The concurrency at which this set-up served the most, and that load's figures."""
        return max(self.loads.items(), key=lambda item: item[1].requests_per_second)

    def figures(self) -> tuple[float, float, float]:
        """p50 and p99 at concurrency 1 (ms), and the max throughput (req/s)."""
        p99 = statistics.quantiles(self.latencies_ms, n=100)[98]
        return statistics.median(self.latencies_ms), p99, self.peak[1].requests_per_second

    @property
    def extproc_us_per_request(self) -> float | None:
        """The ext_proc process's CPU per request at its peak (background work included)."""
        load = self.peak[1]
        if not self.extproc_pid or not load.completed:
            return None
        return load.extproc_cpu_seconds / load.completed * 1e6


@dataclasses.dataclass
class Load:
    """A set-up's throughput phases at one concurrency, summed over the rounds."""

    completed: int = 0  # answered 200
    failed: int = 0  # answered otherwise (a 503 when every pod's metrics went stale)
    busy_seconds: float = 0.0
    extproc_cpu_seconds: float = 0.0  # the ext_proc process's CPU time
    children_cpu_seconds: float = 0.0  # its child processes' (policyd's scraper)
    machine_busy_seconds: float = 0.0  # CPU seconds the whole machine used
    envoy_cpu_seconds: float = 0.0  # Envoy's
    client_cpu_seconds: float = 0.0  # this process's (the load generator)
    phases: list[Phase] = dataclasses.field(default_factory=list)  # one per round

    @property
    def requests_per_second(self) -> float:
        return self.completed / self.busy_seconds if self.busy_seconds else 0.0

    @property
    def children_us_per_request(self) -> float:
        return self.children_cpu_seconds / self.completed * 1e6 if self.completed else 0.0


@dataclasses.dataclass(frozen=True)
class Phase:
    """One round's throughput phase of a set-up with an ext_proc process."""

    completed: int
    cpu_seconds: float  # the ext_proc process's and its children's (policyd's scraper)

    @property
    def us_per_request(self) -> float:
        return self.cpu_seconds / self.completed * 1e6 if self.completed else float("nan")


def start_envoy(
    name: str,
    directory: Path,
    extproc_port: int | None,
    pod: str,
    extproc_pid: int | None = None,
    *,
    runtime: dict[str, bool] | None = None,
    tree: Path | None = None,
) -> SetUp:
    """``runtime`` overrides runtime flags of the generated bootstrap's static layer;
    with ``tree``, the bootstrap is that checkout's own (``--versus``)."""
    listen, admin = free_port(), free_port()
    options = EnvoyConfigOptions(port=listen, admin_port=admin, policyd_port=extproc_port or 1)
    config = bootstrap(options) if tree is None else tree_bootstrap(tree, options)
    if runtime:
        config["layered_runtime"]["layers"][0]["static_layer"].update(runtime)
    headers = {"content-type": "application/json"}
    if extproc_port is None:  # (a): no ext_proc filter; the client names the pod itself
        manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        filters = manager["typed_config"]["http_filters"]
        filters[:] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
        # ... and keeps the destination header the bootstrap strips from clients.
        manager["typed_config"].pop("early_header_mutation_extensions", None)
        headers[replies.DESTINATION_HEADER] = pod
    key = name.split(")", maxsplit=1)[0].strip("(")
    path = directory / f"{key}.yaml"
    path.write_text(yaml.safe_dump(config))
    envoy = EnvoyProcess(path, admin, log_file=directory / f"{key}.log")
    envoy.start()
    url = f"http://127.0.0.1:{listen}/v1/completions"
    return SetUp(name, url, headers, envoy, extproc_pid=extproc_pid)


def tree_python(tree: Path) -> str:
    return str(tree / ".venv" / "bin" / "python")


def tree_bootstrap(tree: Path, options: EnvoyConfigOptions) -> dict[str, Any]:
    """The bootstrap another checkout of policyd writes for ``options``' ports."""
    code = (
        "import json; from policyd.extproc.envoy_config import EnvoyConfigOptions, bootstrap; "
        f"print(json.dumps(bootstrap(EnvoyConfigOptions(port={options.port}, "
        f"admin_port={options.admin_port}, policyd_port={options.policyd_port}))))"
    )
    written = subprocess.run(
        [tree_python(tree), "-c", code], cwd=tree, capture_output=True, check=True, text=True
    )
    config: dict[str, Any] = json.loads(written.stdout)
    return config


class TreeProcess:
    """(v)'s policyd: ``run_policyd`` of another checkout, in that checkout's Python."""

    def __init__(self, tree: Path, port: int, pods_file: str, scrape_in_process: bool) -> None:
        code = (
            "import sys; sys.path.insert(0, 'benchmarks'); from overhead import run_policyd; "
            f"run_policyd({port}, {pods_file!r}, '', {scrape_in_process})"
        )
        self.process = subprocess.Popen([tree_python(tree), "-c", code], cwd=tree)
        self.pid: int | None = self.process.pid

    def terminate(self) -> None:
        self.process.terminate()

    def join(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)


async def measure(set_ups: list[SetUp], arguments: argparse.Namespace) -> None:
    """Rounds that visit every set-up in turn, so drift on a shared machine hits all alike
    (in the reverse order every other round, so no set-up always follows the same one)."""
    for set_up in set_ups:
        await set_up.envoy.wait_ready()
        connector = aiohttp.TCPConnector(limit=max(arguments.concurrency))
        set_up.session = aiohttp.ClientSession(connector=connector)
        for _ in range(50):  # warm up connections and code paths
            await set_up.one_ok()
    rounds = arguments.rounds
    for number in range(rounds):
        for set_up in set_ups if number % 2 == 0 else reversed(set_ups):
            await set_up.sequential(arguments.requests // rounds)
    for number in range(rounds):
        for concurrency in arguments.concurrency:
            for set_up in set_ups if number % 2 == 0 else reversed(set_ups):
                await set_up.saturate(arguments.seconds / rounds, concurrency)


@dataclasses.dataclass
class Processes:
    """The helper processes by set-up key ("pods", "b", "c", "c'", "d", "collector"),
    and the ports."""

    running: dict[str, multiprocessing.process.BaseProcess | TreeProcess]
    ports: dict[str, int]
    pods: list[str]  # addresses
    spans: Any  # the collector stand-in's count of spans received (a shared value)

    def pid(self, key: str) -> int:
        pid = self.running[key].pid
        assert pid is not None
        return pid

    def stop(self) -> None:
        for process in self.running.values():
            process.terminate()
        for process in self.running.values():
            process.join(10)


def start_processes(arguments: argparse.Namespace, directory: Path) -> Processes:
    """The pods, then the ext_proc servers (policyd once the pods are up)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    pods = context.Process(target=run_pods, args=(arguments.pods, queue), daemon=True)
    pods.start()
    started = Processes({"pods": pods}, {}, [], context.Value("q", 0))
    try:
        started.pods = [f"127.0.0.1:{port}" for port in queue.get(timeout=60)]
        pods_file = write_pods_file(directory / "pods.yaml", started.pods)
        first = started.pods[0]
        targets: dict[str, tuple[Any, tuple[Any, ...]]] = {
            "b": (run_noop_extproc, (first,)),
            "c": (
                run_policyd,
                (str(pods_file), arguments.profile or "", arguments.scrape_in_process),
            ),
        }
        if arguments.naive:
            targets["b'"] = (run_naive_extproc, (started.pods,))
        if arguments.pick_first:
            targets["c'"] = (run_pick_first, (first,))
        if arguments.tracing:
            collector = started.ports["collector"] = free_port()
            started.running["collector"] = context.Process(
                target=run_collector, args=(collector, started.spans), daemon=True
            )
            started.running["collector"].start()
            endpoint = f"127.0.0.1:{collector}"
            targets["d"] = (
                run_policyd,
                (
                    str(pods_file),
                    (arguments.profile + ".d") if arguments.profile else "",
                    arguments.scrape_in_process,
                    endpoint,
                ),
            )
            if arguments.sample_ratio is not None:
                targets["d'"] = (
                    run_policyd,
                    (
                        str(pods_file),
                        "",
                        arguments.scrape_in_process,
                        endpoint,
                        arguments.sample_ratio,
                    ),
                )
        for key, (target, target_arguments) in targets.items():
            port = started.ports[key] = free_port()
            process = context.Process(target=target, args=(port, *target_arguments), daemon=True)
            process.start()
            started.running[key] = process
        if arguments.versus:
            port = started.ports["v"] = free_port()
            started.running["v"] = TreeProcess(
                arguments.versus, port, str(pods_file), arguments.scrape_in_process
            )
        for key in started.ports:
            if key != "collector":
                wait_for_port(started.ports[key])
    except BaseException:
        started.stop()
        raise
    return started


async def main(arguments: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="policyd-bench-") as temporary:
        directory = Path(temporary)
        processes = start_processes(arguments, directory)
        set_ups: list[SetUp] = []
        samplers: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for key in ("c", "d", "d'", "v"):
                if key in processes.running:
                    await policyd_ready(processes.ports[key], len(processes.pods))
            idle_core, idle_children = await cpu_share(processes.pid("c"), seconds=3.0)
            samplers |= {
                key: start_sampler(processes.pid(key), arguments.sample + suffix)
                for key, suffix in (("c", ""), ("v", ".v"))
                if arguments.sample and key in processes.running
            }
            first = processes.pods[0]
            set_ups.append(start_envoy("(a) envoy -> pod", directory, None, first))
            for key, name in (
                ("b", "(b) + no-op ext_proc"),
                ("b'", "(b') + naive routing ext_proc"),
                ("c", f"(c) + policyd, {arguments.pods} pods"),
                ("c'", "(c') + policyd pick-first"),
                ("d", "(d) + policyd with tracing"),
                ("d'", f"(d') + tracing {arguments.sample_ratio}"),
                ("v", f"(v) + policyd at {arguments.versus}"),
            ):
                if key in processes.running:
                    tree = arguments.versus if key == "v" else None
                    set_ups.append(
                        start_envoy(
                            name,
                            directory,
                            processes.ports[key],
                            first,
                            processes.pid(key),
                            tree=tree,
                        )
                    )
            collector = processes.running.get("collector")
            collector_cpu = process_cpu_seconds(collector.pid) if collector else 0.0
            await measure(set_ups, arguments)
            for sampler in samplers.values():
                sampler.send_signal(signal.SIGINT)  # py-spy writes its file and exits
                sampler.wait(60)
            if "d" in processes.running:
                await asyncio.sleep(6)  # the batch processor exports every 5 s
            spans = processes.spans.value
            if collector is not None:
                collector_cpu = process_cpu_seconds(collector.pid) - collector_cpu
        finally:
            await stop_all(set_ups, processes)
    report(set_ups)
    if arguments.versus:
        report_versus(set_ups, arguments.concurrency)
    for key, suffix in (("c", ""), ("v", ".v")):
        if key in samplers:
            print_profile(f"({key})", Path(arguments.sample + suffix))
    where = "on its serving loop" if arguments.scrape_in_process else "in its scraper child"
    print(
        f"policyd with no requests (scraping {arguments.pods} pods every 100 ms {where}): "
        f"serving process {idle_core:.3f} of a core, child processes {idle_children:.3f}"
    )
    for set_up in set_ups:
        if set_up.name.startswith("(c)"):
            print(
                f"(c) child processes' CPU during the throughput phases at its peak: "
                f"{set_up.peak[1].children_us_per_request:.0f} us/req (not in the table)"
            )
        if set_up.name.startswith("(d)"):
            served = sum(load.completed for load in set_up.loads.values())
            served += len(set_up.latencies_ms)
            print(
                f"(d) spans the collector received: {spans} for {served} requests "
                + ("(with (d')'s) " if "d'" in processes.running else "")
                + "(the SDK drops spans when its export queue is full); the collector "
                f"stand-in's CPU: {collector_cpu / max(spans, 1) * 1e6:.0f} us per span"
            )


async def stop_all(set_ups: list[SetUp], processes: Processes) -> None:
    """Close the set-ups' client sessions and Envoys, then stop the helper processes."""
    for set_up in set_ups:
        if set_up.session is not None:
            await set_up.session.close()
        set_up.envoy.stop()
    processes.stop()


async def policyd_ready(port: int, pods: int) -> None:
    """Wait for policyd's readiness (every pod scraped once) before Envoy's first health check."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.aio.AioRpcError):
                answer = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"policyd did not get ready over {pods} pods")


async def cpu_share(pid: int, seconds: float) -> tuple[float, float]:
    """CPU seconds per wall second the process, and its children, used over ``seconds``."""

    before, children = process_cpu_seconds(pid), children_cpu_seconds(pid)
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    after = children_cpu_seconds(pid)
    wall = time.perf_counter() - started
    children_used = sum(after[child] - children[child] for child in after.keys() & children.keys())
    return (process_cpu_seconds(pid) - before) / wall, children_used / wall


def report(set_ups: list[SetUp]) -> None:
    """The table (latency at concurrency 1; each set-up's max throughput over the
    concurrencies tried, and the CPU per request there), then where the CPU went at
    each peak, in cores (CPU seconds per second): the ext_proc server's process
    (near 1.0: it is the bottleneck), Envoy's, this process's (the load
    generator), the machine's; then throughput at every concurrency."""
    print(
        f"{'set-up':<30}{'p50 ms':>9}{'p99 ms':>9}{'max req/s':>10}{'at':>5}"
        f"{'ext_proc CPU us/req':>21}"
    )
    results = {set_up.name.split(")")[0] + ")": set_up for set_up in set_ups}
    for set_up in set_ups:
        p50, p99, rps = set_up.figures()
        cpu = set_up.extproc_us_per_request
        print(
            f"{set_up.name:<30}{p50:>9.3f}{p99:>9.3f}{rps:>10.0f}{set_up.peak[0]:>5}"
            + (f"{cpu:>21.0f}" if cpu is not None else f"{'-':>21}")
        )
    print(f"{'cores at the peak':<30}{'ext_proc':>9}{'envoy':>9}{'client':>9}{'machine':>9}")
    for set_up in set_ups:
        load = set_up.peak[1]
        wall = load.busy_seconds
        extproc = load.extproc_cpu_seconds / wall if set_up.extproc_pid else None
        print(
            f"{set_up.name:<30}"
            + (f"{extproc:>9.2f}" if extproc is not None else f"{'-':>9}")
            + f"{load.envoy_cpu_seconds / wall:>9.2f}{load.client_cpu_seconds / wall:>9.2f}"
            f"{load.machine_busy_seconds / wall:>9.2f}"
        )
    levels = sorted(set_ups[0].loads)
    print("req/s by concurrency: " + ", ".join(map(str, levels)))
    for set_up in set_ups:
        print(f"{set_up.name:<30}" + "".join(f"{set_up.rate(level):>9.0f}" for level in levels))
    for set_up in set_ups:
        failed = {level: load.failed for level, load in sorted(set_up.loads.items()) if load.failed}
        if failed:
            print(
                f"{set_up.name}: answers other than 200 in the throughput phases, not counted: "
                + ", ".join(f"{count} at {level}" for level, count in failed.items())
            )
    for label, base, more in (
        ("ext_proc floor (b)-(a)", "(a)", "(b)"),
        ("policyd extra  (c)-(b)", "(b)", "(c)"),
        ("naive router  (b')-(b)", "(b)", "(b')"),
        ("policyd/naive (c)-(b')", "(b')", "(c)"),
        ("serving path  (c')-(b)", "(b)", "(c')"),
        ("tracing       (d)-(c)", "(c)", "(d)"),
        ("sampled      (d')-(c)", "(c)", "(d')"),
    ):
        if base in results and more in results:
            (base50, base99, base_rps), (p50, p99, rps) = (
                results[base].figures(),
                results[more].figures(),
            )
            same_load = ", ".join(
                f"x{results[more].rate(level) / results[base].rate(level):.2f} at {level}"
                for level in levels
            )
            print(
                f"{label}: p50 {p50 - base50:+.3f} ms, p99 {p99 - base99:+.3f} ms, "
                f"max req/s x{rps / base_rps:.2f} ({same_load})"
            )
    print(
        "goals (issue 24): (c) - (b) p50 <= +0.5 ms at concurrency 1; (c) max req/s >= 0.75 x (b)'s"
    )
    if "(d)" in results:
        print("tracing at 100% sampling, (d) max req/s / (c)'s: recorded (issue 24)")
    if "(d')" in results:
        print("goal: tracing at the recommended sampling, (d') max req/s >= 0.85 x (c)'s")


def report_versus(set_ups: list[SetUp], levels: Sequence[int]) -> None:
    """(c) against (v), round by round: CPU per request, serving process plus scraper."""
    this = next(set_up for set_up in set_ups if set_up.name.startswith("(c)"))
    other = next(set_up for set_up in set_ups if set_up.name.startswith("(v)"))
    for level in levels:
        ours, theirs = this.loads[level].phases, other.loads[level].phases
        ratios = [a.us_per_request / b.us_per_request for a, b in zip(ours, theirs, strict=True)]
        rates = [a.completed / b.completed for a, b in zip(ours, theirs, strict=True)]
        cpu_ours = statistics.median(phase.us_per_request for phase in ours)
        cpu_theirs = statistics.median(phase.us_per_request for phase in theirs)
        print(
            f"CPU per request, serving process + scraper, at concurrency {level}, "
            f"{len(ratios)} rounds: (c) median {cpu_ours:.0f} us, "
            f"(v) {cpu_theirs:.0f} us; (c)/(v) median "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
            f"requests (c)/(v) median {statistics.median(rates):.3f}"
        )


def start_sampler(pid: int, output: str) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` and its child processes until it is sent SIGINT."""
    py_spy = Path(sys.executable).with_name("py-spy")
    command = [str(py_spy), "record", "--pid", str(pid), "--subprocesses", "--nolineno"]
    command += ["--format", "raw", "--rate", "100", "--output", output]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# Frames py-spy counts as running though they wait (a pipe's recv, epoll, idle pool
# threads): left out of the shares.
WAITING = (
    "_Channel._recv (policyd/pool/scrape_child.py)",
    "EpollSelector.select (selectors.py)",
    "_worker (concurrent/futures/thread.py)",
    "ThreadedChildWatcher._do_waitpid (asyncio/unix_events.py)",
)


def where(stack: str, frames: list[str]) -> str:
    """The part of policyd a sample's stack is in."""
    leaf = frames[-1]
    if "-m policyd.pool.scrape_child" in stack:  # the child process's command line
        return "scraper child"
    if any(frame.startswith("Thread.run ") for frame in frames):
        return "gRPC's poller thread (in C)"
    if leaf.startswith("Handle._run "):
        return "event-loop callbacks in C (gRPC's Cython, asyncio)"
    if leaf.startswith("ExternalProcessor.Process "):
        return "the Process stream's frame (gRPC reads and writes, decoding, in C)"
    if "(policyd/" in leaf:
        return "policyd's Python"
    return "asyncio's Python" if "asyncio/" in leaf else "other Python"


def print_profile(name: str, path: Path, top: int = 15) -> None:
    """Shares of the samples in py-spy's collapsed stacks that were not waiting: by
    part (``where``), then the frames most often on top of the stack."""
    parts: Counter[str] = Counter()
    own: Counter[str] = Counter()
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        # Each process ('process PID:"command line"', a child's after its parent's),
        # then the thread, then the frames ("function (file)").
        frames = [
            frame
            for frame in stack.split(";")
            if frame.endswith(")") and not frame.startswith(("process ", "thread "))
        ]
        if not frames or frames[-1] in WAITING:
            continue
        samples += count
        parts[where(stack, frames)] += count
        own[frames[-1]] += count
    print(f"{name} py-spy samples not waiting: {samples}, by part:")
    for part, count in parts.most_common():
        print(f"  {count / samples:6.1%}  {part}")
    print(f"{name} frames on top of the stack:")
    for frame, count in own.most_common(top):
        print(f"  {count / samples:6.1%}  {frame}")


def concurrency_levels(text: str) -> list[int]:
    levels = sorted({int(part) for part in text.split(",")})
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive: {text!r}")
    return levels


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1200, help="sequential requests per set-up")
    parser.add_argument(
        "--seconds", type=float, default=6.0, help="throughput phase per set-up and concurrency"
    )
    parser.add_argument(
        "--concurrency",
        type=concurrency_levels,
        default=[16, 64, 128],
        help="comma-separated concurrencies for the throughput phases; max throughput "
        "is each set-up's best over them",
    )
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds per phase")
    parser.add_argument("--pods", type=int, default=100, help="pods policyd scrapes and routes to")
    parser.add_argument(
        "--naive", action="store_true", help="also measure (b'): a naive routing ext_proc"
    )
    parser.add_argument(
        "--pick-first", action="store_true", help="also measure (c'): serving path, no policy"
    )
    parser.add_argument(
        "--tracing", action="store_true", help="also measure (d): (c) exporting a span per request"
    )
    parser.add_argument(
        "--sample-ratio",
        type=float,
        help="with --tracing, also measure (d'): (d) recording this share of requests",
    )
    parser.add_argument(
        "--scrape-in-process",
        action="store_true",
        help="(c) scrapes on its serving loop, not in a scraper child (the old default)",
    )
    parser.add_argument("--profile", metavar="FILE", help="write a cProfile of policyd's process")
    parser.add_argument(
        "--versus",
        type=Path,
        metavar="TREE",
        help="also measure (v): policyd as the checkout TREE (with its .venv) runs it",
    )
    parser.add_argument(
        "--sample",
        metavar="FILE",
        help="sample (c)'s (and (v)'s) processes with py-spy into FILE (and FILE.v)",
    )
    asyncio.run(main(parser.parse_args()))
