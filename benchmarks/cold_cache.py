"""What policyd's request handling costs when the caches are cold, as they are under load.

    python benchmarks/cold_cache.py [--requests 1500] [--rounds 4] [--flush-mb 4] [--tracing]
                                    [--naive]

Through the real Envoy (``overhead.py``) policyd's serving code costs ~3-4x
what the same code costs in a hot loop: between two ext_proc messages of a
request, Envoy, the client, the pods and gRPC run on the same cores and
evict policyd's code and data from the caches and the TLB. A hot loop hides
that, so a change that saves hot-loop time may save little where it counts.

This runs one request's four ext_proc messages (request headers, a BUFFERED
body, response headers, a JSON response body with ``usage``) through
``Exchange`` as ``policyd serve`` builds it (``rules/default.yaml``, 100 pods,
Prometheus metrics on; with ``--tracing`` a span per request, recorded and
handed to a processor that drops it), timing each message's handling:

- hot: message after message;
- flushed: ``--flush-mb`` of memory written before every message (not timed),
  which evicts the caches and much of the TLB as the other processes do.

The bookkeeping a request leaves for later (``policyd/extproc/settlement.py``:
metrics, span, usage) is settled every ``--batch`` requests, as the event
loop's timer does every few milliseconds (5 ms at ~1000 requests/s is ~5);
in the flushed mode the caches are flushed before each batch as well.
``--batch 1`` settles each request on its own, as if nothing were deferred.

``--naive`` times ``overhead.py``'s naive routing ext_proc (b') on the same
messages as well, each reply serialized as gRPC would: the least Python a
router does per request, next to policyd's.

Rounds alternate the modes; medians are printed, with flushed / hot as the
figure to compare across runs (the machine's speed drifts).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from policyd.extproc.exchange import Exchange
from policyd.extproc.process_stream import ExternalProcessor
from policyd.extproc.serving import ServingSettings
from policyd.extproc.settlement import Settlement, Work
from policyd.policy import PolicyStore, Router
from policyd.telemetry import DecisionTracer, build_telemetry

sys.path.insert(0, str(Path(__file__).parent))
from decision import make_pool  # the decision benchmark's pool of 100 pods
from overhead import (  # the request and answer overhead.py sends through Envoy, and (b')
    ANSWER,
    BODY,
    NaiveExchange,
    NaiveRouter,
)

REPO = Path(__file__).resolve().parents[1]

PHASES = ("request headers", "request body", "response headers", "response body", "settling")


class Batches(Settlement):
    """The server's settlement, flushed by the benchmark rather than by a timer."""

    def add(self, work: Work) -> None:
        self._queue.append(work)


class Dropped(SpanProcessor):
    """Takes finished spans and keeps none (the recording is measured, not the export)."""

    def on_end(self, span: ReadableSpan) -> None:
        return None


def headers(pairs: list[tuple[str, str]], end_of_stream: bool = False) -> pb.HttpHeaders:
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end_of_stream)


def messages() -> list[bytes]:
    """One request's messages as Envoy sends them (wire bytes)."""
    first = pb.ProcessingRequest(
        request_headers=headers(
            [
                (":authority", "127.0.0.1:10000"),
                (":path", "/v1/completions"),
                (":method", "POST"),
                (":scheme", "http"),
                ("user-agent", "Python/3.11 aiohttp/3.9"),
                ("content-type", "application/json"),
                ("content-length", str(len(BODY))),
                ("x-forwarded-proto", "http"),
                ("x-request-id", "5f0c8a52-5b7e-4c8e-9d1a-0c9f6f3c2a11"),
            ]
        )
    )
    first.protocol_config.request_body_mode = 1  # BUFFERED
    response_headers = [
        (":status", "200"),
        ("content-type", "application/json"),
        ("content-length", str(len(ANSWER))),
        ("x-envoy-upstream-service-time", "1"),
    ]
    return [
        first.SerializeToString(),
        pb.ProcessingRequest(
            request_body=pb.HttpBody(body=BODY, end_of_stream=True)
        ).SerializeToString(),
        pb.ProcessingRequest(response_headers=headers(response_headers)).SerializeToString(),
        pb.ProcessingRequest(
            response_body=pb.HttpBody(body=ANSWER, end_of_stream=True)
        ).SerializeToString(),
    ]


def build_server(tracing: bool) -> ExternalProcessor:
    router = Router(PolicyStore.open(REPO / "rules" / "default.yaml"))
    candidates = tuple(make_pool(100, random.Random(1)))

    class Snapshot:
        pass

    snapshot: Any = Snapshot()
    snapshot.candidates = candidates
    telemetry = build_telemetry(tracing=False)
    if tracing:
        telemetry.tracer = DecisionTracer(processors=[Dropped()])
    server = ExternalProcessor(lambda: router, lambda: snapshot, telemetry, ServingSettings())
    server.settlement = Batches()
    return server


class PolicydRequest:
    """One request through policyd's ``Exchange``, as its servicer drives it."""

    def __init__(self, server: ExternalProcessor) -> None:
        self.exchange = Exchange(server, tuple)

    def message(self, message: pb.ProcessingRequest) -> None:
        if self.exchange.handle(message) is not None:
            self.exchange.reply_sent()

    def close(self) -> None:
        self.exchange.close()


class NaiveRequest:
    """One request through (b'), its replies serialized as gRPC does for a plain servicer."""

    def __init__(self, router: NaiveRouter) -> None:
        self.exchange = NaiveExchange(router)

    def message(self, message: pb.ProcessingRequest) -> None:
        self.exchange.handle(message).SerializeToString()

    def close(self) -> None:
        return None


def run(
    server: ExternalProcessor,
    wire: list[bytes],
    count: int,
    batch: int,
    flush: bytearray | None,
    *,
    naive: NaiveRouter | None = None,
) -> list[float]:
    """Seconds per message phase and in settling, summed over ``count`` requests
    (through (b') instead of policyd with ``naive``; it settles nothing)."""
    zero = bytes(len(flush)) if flush is not None else b""
    clock = time.perf_counter
    parse = pb.ProcessingRequest.FromString
    totals = [0.0] * (len(wire) + 1)
    for done in range(1, count + 1):
        request = PolicydRequest(server) if naive is None else NaiveRequest(naive)
        for index, raw in enumerate(wire):
            if flush is not None:
                flush[:] = zero
            start = clock()
            request.message(parse(raw))
            totals[index] += clock() - start
        request.close()
        if done % batch == 0 or done == count:
            if flush is not None:
                flush[:] = zero
            start = clock()
            server.settlement.flush()
            totals[-1] += clock() - start
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500, help="requests per round and mode")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--flush-mb", type=int, default=4, help="memory written before each message"
    )
    parser.add_argument("--tracing", action="store_true", help="a span per request (recorded)")
    parser.add_argument("--batch", type=int, default=5, help="requests settled together")
    parser.add_argument(
        "--naive", action="store_true", help="also time overhead.py's naive routing ext_proc (b')"
    )
    arguments = parser.parse_args()
    server = build_server(arguments.tracing)
    wire = messages()
    flush = bytearray(arguments.flush_mb * 1024 * 1024)
    routers: dict[str, NaiveRouter | None] = {"policyd": None}
    if arguments.naive:
        routers["(b')"] = NaiveRouter([f"127.0.0.1:{8000 + i}" for i in range(100)])
    for naive in routers.values():  # warm up: caches of the policy and telemetry filled
        run(server, wire, 500, arguments.batch, None, naive=naive)
    results: dict[tuple[str, str], list[list[float]]] = {}
    for _ in range(arguments.rounds):
        for who, naive in routers.items():
            for mode, buffer in (("hot", None), ("flushed", flush)):
                seconds = run(
                    server, wire, arguments.requests, arguments.batch, buffer, naive=naive
                )
                rounds = results.setdefault((who, mode), [])
                rounds.append([s / arguments.requests * 1e6 for s in seconds])
    medians = {
        key: [statistics.median(r[i] for r in rounds) for i in range(len(PHASES))]
        for key, rounds in results.items()
    }
    what = "with tracing" if arguments.tracing else "tracing off"
    for who in routers:
        through = "Exchange" if who == "policyd" else "the naive routing ext_proc (b')"
        print(
            f"== one request's ext_proc messages through {through} ({what}, settled in "
            f"batches of {arguments.batch}), us per request"
        )
        print(f"{'phase':20s} {'hot':>8s} {'flushed':>8s} {'flushed/hot':>12s}")
        hot_phases, cold_phases = medians[(who, "hot")], medians[(who, "flushed")]
        for phase, hot, cold in zip(PHASES, hot_phases, cold_phases, strict=True):
            ratio = f"{cold / hot:11.1f}x" if hot else f"{'-':>12s}"
            print(f"{phase:20s} {hot:8.1f} {cold:8.1f} {ratio}")
        hot, cold = sum(hot_phases), sum(cold_phases)
        print(f"{'all':20s} {hot:8.1f} {cold:8.1f} {cold / hot:11.1f}x")


if __name__ == "__main__":
    main()
