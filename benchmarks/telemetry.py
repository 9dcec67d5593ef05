"""What telemetry costs per request, and proof that shadow policies do not delay replies.

    python benchmarks/telemetry.py [--pods 100] [--requests 2000] [--replies 600]

Part 1, in process: the real Router (rules/scorers.yaml over ``--pods`` pods)
decides each request, then each telemetry set-up records it the way the
serving path calls it (``start`` before the reply; ``after_reply``,
``response_headers`` and ``end`` after). Printed per request, split into the
part before the reply and the part after, as ratios to ``Router.decide`` in
the same run. Spans (``DecisionTracer``) go to a batch processor whose
exporter keeps the first ``--requests`` and discards the rest (the export runs
on the processor's thread); the decision log writes to /dev/null. Then the
kept spans are OTLP-encoded by the SDK's encoder (what the stock
``OTLPSpanExporter`` does on the batch processor's thread), per span.

Part 2, over real gRPC: policyd's ext_proc server in its own process, the
live policy scorers.yaml over ``--pods`` pods; a client in this process sends
request headers + body and times the routing reply, one request at a time.
Three servers: no shadows; three shadow policies (policyd: evaluated after
the reply); the same three evaluated before the reply (what the reply would
cost if they were not deferred). Printed as p50/p99 and ratios to the first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from processes import wait_for_port

from policyd.extproc.envoy_process import free_port
from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.policy import PolicyStore, Request, Router
from policyd.policy.decision import Decision, ShadowReport
from policyd.pool.pod import Pod
from policyd.telemetry import DecisionLog, DecisionMetrics, DecisionTelemetry, DecisionTracer
from policyd.telemetry.exchange_end import ExchangeEnd

RULES = Path(__file__).resolve().parents[1] / "rules"
SHADOWS = ("default.yaml", "random.yaml", "round-robin.yaml")


def make_pods(count: int, seed: int = 1) -> list[Pod]:
    rng = random.Random(seed)
    return [
        Pod(
            f"vllm-{i}",
            f"10.0.{i // 250}.{i % 250 + 1}:8000",
            waiting_queue=rng.randrange(0, 20),
            running=rng.randrange(0, 8),
            kv_cache=rng.random(),
            active_loras=tuple(f"adapter-{rng.randrange(8)}" for _ in range(rng.randrange(3))),
            max_loras=4,
        )
        for i in range(count)
    ]


def live_policy(directory: Path, shadows: bool) -> Path:
    text = (RULES / "scorers.yaml").read_text()
    if shadows:
        text += "\nshadows: [" + ", ".join(str(RULES / s) for s in SHADOWS) + "]\n"
    path = directory / ("with-shadows.yaml" if shadows else "live.yaml")
    path.write_text(text)
    return path


# -- part 1: per-request cost in process ----------------------------------------------------


class Keep(SpanExporter):
    """Keeps the first ``limit`` spans (to encode them after), discards the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans[: self.limit - len(self.spans)])
        return SpanExportResult.SUCCESS


def encoding(spans: Sequence[ReadableSpan]) -> None:
    """OTLP-encoding those decision spans as the stock exporter does, per span."""
    batches = [spans[i : i + 512] for i in range(0, len(spans), 512)]
    started = time.perf_counter()
    for batch in batches:
        encode_spans(batch).SerializeToString()
    sdk_us = (time.perf_counter() - started) / len(spans) * 1e6
    print(f"OTLP encoding of {len(spans)} of those spans (batches of 512)")
    print(f"SDK encode_spans + serialize  {sdk_us:7.1f} us per span")


def request(i: int) -> Request:
    return Request(
        model="adapter-3",
        id=f"req-{i}",
        path="/v1/chat/completions",
        prompt_tokens=200,
        max_tokens=64,
        headers={"x-request-id": f"req-{i}"},
    )


CARRIER = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def per_request(
    name: str, telemetry: DecisionTelemetry | None, decisions: list[Decision], rounds: int
) -> tuple[str, float, float]:
    """Median over rounds of the mean microseconds before / after the reply."""
    before: list[float] = []
    after: list[float] = []
    for _ in range(rounds):
        if telemetry is None:
            break
        b = a = 0.0
        requests = [request(i) for i in range(len(decisions))]
        for asked, decision in zip(requests, decisions, strict=True):
            t0 = time.perf_counter()
            record = telemetry.start(asked, decision, CARRIER, 0.0002)
            _ = record.upstream_headers
            t1 = time.perf_counter()
            record.after_reply()
            record.response_headers(200, 0.05)
            record.end(
                ExchangeEnd(
                    completed=True,
                    duration_seconds=0.5,
                    first_body_seconds=0.1,
                    prompt_tokens=200,
                    completion_tokens=64,
                )
            )
            t2 = time.perf_counter()
            b += t1 - t0
            a += t2 - t1
        before.append(b / len(decisions) * 1e6)
        after.append(a / len(decisions) * 1e6)
    if not before:
        return name, 0.0, 0.0
    return name, statistics.median(before), statistics.median(after)


def part_one(pods_count: int, count: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        router = Router(PolicyStore.open(live_policy(Path(tmp), shadows=False)))
    pods = make_pods(pods_count)
    started = time.perf_counter()
    decisions = [router.decide(request(i), pods) for i in range(count)]
    decide_us = (time.perf_counter() - started) / count * 1e6

    kept = Keep(limit=count)
    tracer = DecisionTracer(
        processors=[BatchSpanProcessor(kept, max_queue_size=count * 2)],
        scope=InstrumentationScope("policyd"),
    )
    devnull = open("/dev/null", "w")  # noqa: SIM115
    log = DecisionLog(devnull, queue_limit=count * 2)
    setups: list[tuple[str, DecisionTelemetry]] = [
        ("nothing", DecisionTelemetry()),
        ("metrics", DecisionTelemetry(metrics=DecisionMetrics())),
        ("spans", DecisionTelemetry(tracer=tracer)),
        ("spans+metrics", DecisionTelemetry(tracer=tracer, metrics=DecisionMetrics())),
        (
            "spans+metrics+log",
            DecisionTelemetry(tracer=tracer, metrics=DecisionMetrics(), decision_log=log),
        ),
    ]
    print(f"part 1: {count} decisions, scorers.yaml over {pods_count} pods")
    print(f"Router.decide: {decide_us:.1f} us per request (the baseline)")
    print(f"{'telemetry':<20}{'before reply':>14}{'after reply':>14}{'total/decide':>15}")
    for name, telemetry in setups:
        _, b, a = per_request(name, telemetry, decisions, rounds=3)
        print(f"{name:<20}{b:>11.1f} us{a:>11.1f} us{(b + a) / decide_us:>14.2f}x")
    tracer.shutdown()
    log.close()
    devnull.close()
    encoding(kept.spans)


# -- part 2: reply latency with shadows over real gRPC --------------------------------------


@dataclass(frozen=True)
class Snapshot:
    candidates: tuple[Pod, ...]


class ShadowsBeforeReply:
    """For contrast only: a router that decides the shadows before the reply, as a
    naive design would (the serving path asks ``decide_shadows`` after it)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.reports: dict[int, ShadowReport | None] = {}

    def decide(self, request: Request, candidates: Sequence[Any], prompt: Any = None) -> Decision:
        decision = self.router.decide(request, candidates, prompt)
        self.reports[id(decision)] = self.router.decide_shadows(decision)
        return decision

    def decide_shadows(self, decision: Decision) -> ShadowReport | None:
        return self.reports.pop(id(decision), None)


def run_server(port: int, policy: str, pods_count: int, inline: bool) -> None:
    live = Router(PolicyStore.open(Path(policy)))
    router: Router | ShadowsBeforeReply = ShadowsBeforeReply(live) if inline else live
    snapshot = Snapshot(tuple(make_pods(pods_count)))
    telemetry = DecisionTelemetry(metrics=DecisionMetrics())
    server = ExtProcServer(
        lambda: router,
        lambda: snapshot,
        telemetry=telemetry,
        options=ServerOptions(port=port, grace_seconds=0),
    )
    asyncio.run(server.run_until_signalled())


def _headers() -> pb.ProcessingRequest:
    pairs = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()
                ]
            )
        )
    )
    message.protocol_config.request_body_mode = 1  # BUFFERED
    return message


BODY = pb.ProcessingRequest(
    request_body=pb.HttpBody(
        body=json.dumps(
            {"model": "adapter-3", "messages": [{"role": "user", "content": "hi"}]}
        ).encode(),
        end_of_stream=True,
    )
)


async def reply_latencies(port: int, count: int) -> list[float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        latencies = []
        for _ in range(count):
            call = stub.Process()
            await call.write(_headers())
            await call.read()
            started = time.perf_counter()
            await call.write(BODY)
            reply = await call.read()
            latencies.append((time.perf_counter() - started) * 1e6)
            assert reply.WhichOneof("response") == "request_body", reply
            await call.done_writing()
            await asyncio.sleep(0.002)  # let the server finish deferred work, as between requests
        return latencies


def part_two(pods_count: int, count: int) -> None:
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        plain = live_policy(Path(tmp), shadows=False)
        shadowed = live_policy(Path(tmp), shadows=True)
        setups: list[tuple[str, str, bool]] = [
            ("no shadows", str(plain), False),
            ("3 shadows (policyd)", str(shadowed), False),
            ("3 shadows before reply", str(shadowed), True),
        ]
        servers: list[tuple[str, int, Any]] = []
        for name, policy, inline in setups:
            port = free_port()
            process = context.Process(
                target=run_server, args=(port, policy, pods_count, inline), daemon=True
            )
            process.start()
            servers.append((name, port, process))
        try:
            for _, port, _ in servers:
                wait_for_port(port)
            results: dict[str, list[float]] = {name: [] for name, _, _ in servers}
            rounds = 3
            for _ in range(rounds):  # interleaved: the machine drifts
                for name, port, _ in servers:
                    results[name] += asyncio.run(reply_latencies(port, count // rounds))
        finally:
            for _, _, process in servers:
                process.terminate()
                process.join(5)
    print()
    print(f"part 2: routing-reply latency over gRPC, {count} requests each, {pods_count} pods")
    base = statistics.median(results["no shadows"])
    print(f"{'server':<26}{'p50':>10}{'p99':>10}{'p50 ratio':>11}")
    for name, latencies in results.items():
        ordered = sorted(latencies)
        p50 = statistics.median(ordered)
        p99 = ordered[int(len(ordered) * 0.99) - 1]
        print(f"{name:<26}{p50:>7.0f} us{p99:>7.0f} us{p50 / base:>10.2f}x")


def main(arguments: argparse.Namespace) -> None:
    part_one(arguments.pods, arguments.requests)
    part_two(arguments.pods, arguments.replies)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--replies", type=int, default=600)
    return parser


if __name__ == "__main__":
    main(_parser().parse_args())
