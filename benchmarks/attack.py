"""Hostile request bodies against ``policyd serve``: others' latency, and memory in a soak.

    python benchmarks/attack.py [--seconds 15] [--others 8] [--soak-seconds 30]
                                [--source DIR]

A fresh ``policyd serve`` (the real command, one worker, ``rules/default.yaml``
over three simulated pods) is driven straight over gRPC as Envoy speaks
ext_proc in the generated configuration (headers with ``content-length``,
then the whole body in one BUFFERED message, then the response).

1. Others' latency. ``--others`` clients send small chat requests back to
   back, each through its response, and the time from a request's headers to
   policyd's routing reply is noted. For ``--seconds`` alone, then for as long
   again while one hostile client, in a process of its own, sends ~3.9 MB
   bodies back to back (4 MiB is Envoy's default buffer limit): ``[{},{},...]``
   messages, ``[[1],[1],...]`` token-id lists, flat token ids, empty strings,
   and a body at policyd's limits (16,384 short messages, which is routed).
   Printed: the others' p50 and p99 in each phase and the ratio of the p99s
   (issue 32's goal: within 2x), and the hostile answers by status.
2. Soak. For ``--soak-seconds``: 16 normal clients whose answers are 2 MiB
   JSON bodies (usage followed by logprobs, as vLLM orders them), two hostile
   clients as above, and header-only streams declaring 16 MiB bodies
   re-opened every second. Printed: the serving process's peak resident
   memory (``VmHWM``) plus its scraper child's, against the Deployment's
   512 MiB, and the normal requests' answers by status.

``--source DIR`` runs the policyd of another checkout (a before/after).
Everything runs on loopback and stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).parent))
from memory import LIMIT_MIB, MIB, REPO, Mode, children, header_map, status_kib
from overhead import policyd_ready, run_pods, write_pods_file
from processes import wait_for_port
from reporting import nearest_rank as percentile

from policyd.extproc.envoy_process import free_port

MODEL = "adapter-1"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
HOSTILE_BYTES = 4 * MIB - 100_000  # under Envoy's default 4 MiB buffer limit
CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_send_message_length", 64 * MIB),
    ("grpc.max_receive_message_length", 64 * MIB),
]
NORMAL = json.dumps(
    {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Summarise this: " + "lorem ipsum " * 100},
        ],
        "max_tokens": 64,
    }
).encode()
SMALL_ANSWER = b'{"choices":[],"usage":{"prompt_tokens":300,"completion_tokens":64}}'


def hostile_bodies() -> list[tuple[str, str, bytes]]:
    """The hostile client's bodies in turn: (name, path, body)."""

    def repeated(key: str, item: bytes) -> bytes:
        head = json.dumps({"model": MODEL})[:-1].encode() + f', "{key}": ['.encode()
        count = (HOSTILE_BYTES - len(head)) // (len(item) + 1)
        return head + b",".join([item] * count) + b"]}"

    at_limits = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 16_384}
    ).encode()
    return [
        ("empty messages", CHAT, repeated("messages", b"{}")),
        ("one-id token lists", COMPLETIONS, repeated("prompt", b"[1]")),
        ("token ids", COMPLETIONS, repeated("prompt", b"1")),
        ("empty strings", EMBEDDINGS, repeated("input", b'""')),
        ("at the limits", CHAT, at_limits),
    ]


def request_messages(
    path: str, body: bytes, index: int, declared: int | None = None
) -> tuple[pb.ProcessingRequest, pb.ProcessingRequest]:
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=header_map(
                {
                    ":method": "POST",
                    ":path": path,
                    ":authority": "gateway",
                    "content-type": "application/json",
                    "content-length": str(declared if declared is not None else len(body)),
                    "x-request-id": f"attack-{index}",
                }
            )
        )
    )
    headers.protocol_config.request_body_mode = Mode.BUFFERED
    headers.protocol_config.response_body_mode = Mode.STREAMED
    return headers, pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


def answer_messages(chunks: list[bytes]) -> list[pb.ProcessingRequest]:
    return [
        pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(
                headers=header_map({":status": "200", "content-type": "application/json"})
            )
        ),
        *(
            pb.ProcessingRequest(
                response_body=pb.HttpBody(body=chunk, end_of_stream=i == len(chunks) - 1)
            )
            for i, chunk in enumerate(chunks)
        ),
    ]


async def one_request(
    stub: pb_grpc.ExternalProcessorStub,
    path: str,
    body: bytes,
    index: int,
    answer: list[bytes],
) -> tuple[str, float]:
    """One request as Envoy sends it: its outcome (``routed`` or policyd's status) and
    the seconds from its headers to policyd's reply to its body."""
    call = stub.Process()
    outcome, latency = "routed", 0.0
    try:
        headers, body_message = request_messages(path, body, index)
        started = time.perf_counter()
        for step, message in enumerate((headers, body_message, *answer_messages(answer))):
            await call.write(message)
            reply = await call.read()
            if step == 1:
                latency = time.perf_counter() - started
            if reply is grpc.aio.EOF:
                break
            if reply.HasField("immediate_response"):
                immediate = reply.immediate_response
                code = json.loads(immediate.body)["error"]["code"] if immediate.body else ""
                outcome = f"{immediate.status.code} {code}"
                latency = time.perf_counter() - started
                break
        await call.done_writing()
        await call.code()
    except grpc.aio.AioRpcError as error:
        outcome = f"grpc {error.code().name}"
    return outcome, latency


def hostile_client(port: int, seconds: float, results: Any, prompts: bool = False) -> None:
    """Send the hostile bodies back to back for ``seconds`` (run in a process of its own,
    so that building and sending them does not slow the measuring client); ``prompts``:
    normal bodies of the same size instead (a ~3.9 MB text prompt), the reference."""
    if prompts:
        text = "lorem ipsum, dolor sit amet. " * (HOSTILE_BYTES // 29)
        body = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 8}).encode()
        bodies = [("text prompts", COMPLETIONS, body)]
    else:
        bodies = hostile_bodies()

    async def run() -> Counter[str]:
        outcomes: Counter[str] = Counter()
        deadline = time.monotonic() + seconds
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)
            index = 0
            while time.monotonic() < deadline:
                name, path, body = bodies[index % len(bodies)]
                outcome, _ = await one_request(stub, path, body, index, [SMALL_ANSWER])
                outcomes[f"{name}: {outcome}"] += 1
                index += 1
        return outcomes

    results.put(dict(asyncio.run(run())))


async def others(
    port: int, clients: int, seconds: float, answer: list[bytes]
) -> tuple[list[float], Counter[str]]:
    """``clients`` normal clients back to back for ``seconds``: latencies and outcomes."""
    latencies: list[float] = []
    outcomes: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
        for _ in range(max(1, clients // 8))
    ]

    async def client(number: int) -> None:
        stub = pb_grpc.ExternalProcessorStub(channels[number % len(channels)])
        index = number * 1_000_000
        while time.monotonic() < deadline:
            outcome, latency = await one_request(stub, CHAT, NORMAL, index, answer)
            outcomes[outcome] += 1
            if outcome == "routed":
                latencies.append(latency)
            index += 1
            await asyncio.sleep(0.005)

    try:
        await asyncio.gather(*(client(n) for n in range(clients)))
    finally:
        for channel in channels:
            await channel.close()
    return latencies, outcomes


async def header_only_streams(port: int, seconds: float) -> int:
    """Re-open 8 streams declaring 16 MiB bodies every second, sending none; how many."""
    opened = 0
    deadline = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        while time.monotonic() < deadline:
            calls = []
            for _ in range(8):
                call = stub.Process()
                headers, _ = request_messages(CHAT, b"", opened, declared=16 * MIB)
                await call.write(headers)
                await call.read()
                calls.append(call)
                opened += 1
            await asyncio.sleep(1.0)
            for call in calls:
                call.cancel()
    return opened


def start_hostile(port: int, seconds: float, prompts: bool = False) -> tuple[Any, Any]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(
        target=hostile_client, args=(port, seconds, results, prompts), daemon=True
    )
    process.start()
    return process, results


async def latency_phase(port: int, arguments: argparse.Namespace) -> None:
    answer = [SMALL_ANSWER]
    phases: list[tuple[str, list[float], Counter[str]]] = []
    senders: dict[str, dict[str, int]] = {}
    for name, sender in (
        ("alone", None),
        ("one prompt client", True),
        ("one hostile client", False),
    ):
        if sender is None:
            phases.append((name, *await others(port, arguments.others, arguments.seconds, answer)))
            continue
        process, results = start_hostile(port, arguments.seconds + 2, prompts=sender)
        await asyncio.sleep(2.0)  # the sending process is up and sending
        phases.append((name, *await others(port, arguments.others, arguments.seconds, answer)))
        senders[name] = results.get(timeout=arguments.seconds + 120)
        process.join()
    print(f"\n1. others' latency, {arguments.others} clients, {arguments.seconds:g} s each phase")
    print(f"{'phase':24} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8}  answers")
    for name, values, outcomes in phases:
        print(
            f"{name:24} {len(values):>8} {percentile(values, 0.5) * 1e3:8.2f}"
            f" {percentile(values, 0.99) * 1e3:8.2f}  {dict(outcomes)}"
        )
    p99 = {name: percentile(values, 0.99) for name, values, _ in phases}
    print(
        f"p99 ratio, hostile / alone: {p99['one hostile client'] / p99['alone']:.2f}x (goal:"
        f" within 2x); hostile / same-size prompts:"
        f" {p99['one hostile client'] / p99['one prompt client']:.2f}x"
    )
    for name, answers in senders.items():
        print(f"{name}'s answers: " + ", ".join(f"{k} x{v}" for k, v in sorted(answers.items())))


async def soak_phase(pid: int, port: int, arguments: argparse.Namespace) -> None:
    idle = status_kib(pid, "VmRSS")
    child = children(pid)
    logprobs = b"0.5," * (128 * 1024)  # 512 KiB
    head = b'{"choices":[{"text":"' + b"t" * 1000 + b'"}],"usage":{"prompt_tokens":300,'
    answer = [head + b'"completion_tokens":64},"prompt_logprobs":[', *[logprobs] * 4, b"0.5]}"]
    processes = [start_hostile(port, arguments.soak_seconds) for _ in range(2)]
    peak_sampled = 0
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak_sampled
        while not stop.is_set():
            total = status_kib(pid, "VmRSS") + sum(status_kib(c, "VmRSS") for c in child)
            peak_sampled = max(peak_sampled, total)
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    (_, outcomes), opened = await asyncio.gather(
        others(port, 16, arguments.soak_seconds, answer),
        header_only_streams(port, arguments.soak_seconds),
    )
    hostile: Counter[str] = Counter()
    for process, results in processes:
        hostile.update(results.get(timeout=arguments.soak_seconds + 120))
        process.join()
    stop.set()
    await sampler
    peak = status_kib(pid, "VmHWM") + sum(status_kib(c, "VmRSS") for c in child)
    print(f"\n2. soak, {arguments.soak_seconds:g} s")
    print(f"normal answers (2 MiB JSON each): {dict(outcomes)}")
    print(f"hostile answers: {sum(hostile.values())}; header-only streams opened: {opened}")
    verdict = "within" if peak < LIMIT_MIB * 1024 else "OVER"
    print(
        f"serving process idle {idle / 1024:.0f} MiB; peak (VmHWM) + scraper child"
        f" {peak / 1024:.0f} MiB ({peak_sampled / 1024:.0f} MiB sampled), {verdict} the"
        f" Deployment's {LIMIT_MIB} MiB"
    )


async def main(arguments: argparse.Namespace) -> None:
    source = Path(arguments.source).resolve()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    pods = context.Process(target=run_pods, args=(3, queue), daemon=True)
    pods.start()
    try:
        addresses = [f"127.0.0.1:{port}" for port in queue.get(timeout=60)]
        with tempfile.TemporaryDirectory(prefix="policyd-attack-") as temporary:
            pods_file = write_pods_file(Path(temporary) / "pods.yaml", addresses)
            port = free_port()
            argv = [
                sys.executable, "-m", "policyd", "serve",
                "--policy", str(source / "rules" / "default.yaml"),
                "--pods", str(pods_file), "--port", str(port),
                "--monitoring-port", "0", "--grace-seconds", "0", "--log-level", "error",
            ]  # fmt: skip
            process = subprocess.Popen(
                argv, cwd=source, env={**os.environ, "PYTHONPATH": str(source)}
            )
            try:
                wait_for_port(port)
                await policyd_ready(port, 3)
                await asyncio.sleep(1.0)
                print(f"policyd from {source}, pid {process.pid}")
                await latency_phase(port, arguments)
                await soak_phase(process.pid, port, arguments)
                if process.poll() is not None:
                    print("policyd DIED")
            finally:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    finally:
        pods.terminate()
        pods.join()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="each latency phase")
    parser.add_argument("--others", type=int, default=8, help="normal clients (default 8)")
    parser.add_argument("--soak-seconds", type=float, default=30.0)
    parser.add_argument("--source", default=str(REPO), help="the checkout whose policyd runs")
    arguments = parser.parse_args()
    asyncio.run(main(arguments))
