"""Peak resident memory of ``policyd serve`` under floods of large request bodies.

    python benchmarks/memory.py [--rounds 3] [--hold 1.0] [--max-buffered-body-mib N]
                                [--source DIR] [--only prompts,models,log]

Each scenario starts a fresh ``policyd serve`` (the real command, one worker,
``rules/default.yaml`` over three simulated pods) and floods it straight over
gRPC the way Envoy speaks ext_proc in the generated configuration: request
headers with ``content-length``, policyd's reply, then the whole body in one
BUFFERED message; a routed stream is then held open ``--hold`` seconds (a
generation) before its response headers and body end. The scenarios are
issue 23's:

- ``prompts``: 128 concurrent requests with a 3 MB prompt, ``--rounds`` waves;
- ``models``: 128 concurrent requests whose model name is 3 MB;
- ``log``: ``--decision-log`` on, 16 concurrent 3.5 MB model names, 200 requests.

Printed per scenario: the serving process's resident memory idle (ready,
before the flood) and its peak (the kernel's high-water mark, ``VmHWM``),
its resident memory after the flood, the scraper child's, their sum
against the 512 MiB the Deployment allows, the answers by status and the
decision log's size. The bound is ``--max-buffered-body-mib`` (policyd's
default when not given). ``--source DIR`` runs the policyd of another
checkout (e.g. a ``git worktree`` of an older commit) for a before/after;
flags that checkout does not know are then not passed. Each scenario is
bounded in time (``--timeout`` seconds for its flood).
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
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).parent))
from overhead import policyd_ready, run_noop_extproc, run_pods, write_pods_file
from processes import wait_for_port

from policyd.extproc.envoy_process import free_port

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
LIMIT_MIB = 512  # the Deployment's memory limit (istio/deployment.yaml)
Mode = processing_mode_pb2.ProcessingMode.BodySendMode


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    requests: int
    body: bytes
    decision_log: bool = False


def scenarios(rounds: int) -> list[Scenario]:
    prompt = json.dumps({"model": "adapter-1", "prompt": "x" * 3_000_000, "max_tokens": 8})
    model = json.dumps({"model": "m" * 3_000_000, "prompt": "hello", "max_tokens": 8})
    model_35 = json.dumps({"model": "m" * 3_500_000, "prompt": "hello", "max_tokens": 8})
    return [
        Scenario("prompts", 128, 128 * rounds, prompt.encode()),
        Scenario("models", 128, 128 * rounds, model.encode()),
        Scenario("log", 16, 200, model_35.encode(), decision_log=True),
    ]


def status_kib(pid: int, key: str) -> int:
    """A ``/proc/PID/status`` figure in KiB (``VmRSS``, ``VmHWM``); 0 if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.extend(int(child) for child in text)
    return found


def header_map(headers: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )


def messages(body: bytes, index: int) -> tuple[pb.ProcessingRequest, ...]:
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=header_map(
                {
                    ":method": "POST",
                    ":path": "/v1/completions",
                    ":authority": "gateway",
                    "content-type": "application/json",
                    "content-length": str(len(body)),
                    "x-request-id": f"mem-{index}",
                }
            )
        )
    )
    headers.protocol_config.request_body_mode = Mode.BUFFERED
    headers.protocol_config.response_body_mode = Mode.STREAMED
    return (
        headers,
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(
                headers=header_map({":status": "200", "content-type": "application/json"})
            )
        ),
        pb.ProcessingRequest(
            response_body=pb.HttpBody(
                body=b'{"usage":{"prompt_tokens":1,"completion_tokens":1}}', end_of_stream=True
            )
        ),
    )


async def one_request(
    stub: pb_grpc.ExternalProcessorStub, body: bytes, index: int, hold: float
) -> str:
    """One request as Envoy sends it; its outcome: ``routed`` or policyd's status.

    The stream is closed as Envoy closes it with ``ext_proc_graceful_grpc_close``
    (half-close, then policyd's status), not reset: a reset stream leaks in
    grpcio (docs/serving.md, "How Envoy ends a stream"), which is not what is
    measured here.
    """
    call = stub.Process()
    outcome = "routed"
    try:
        for step, message in enumerate(messages(body, index)):
            if step == 2:
                await asyncio.sleep(hold)  # the generation, before response headers
            await call.write(message)
            reply = await call.read()
            if reply is grpc.aio.EOF:
                outcome = "closed"
                break
            if reply.HasField("immediate_response"):
                outcome = str(reply.immediate_response.status.code)
                break
        await call.done_writing()  # as Envoy half-closes, after an answer of policyd's too
        await call.code()  # policyd's status ends the stream
        return outcome
    except grpc.aio.AioRpcError as error:
        return f"grpc {error.code().name}"


async def flood(port: int, scenario: Scenario, hold: float) -> Counter[str]:
    # Envoy spreads its streams over connections of 32 streams each.
    channels = [
        grpc.aio.insecure_channel(
            f"127.0.0.1:{port}",
            options=[
                ("grpc.use_local_subchannel_pool", 1),
                ("grpc.max_send_message_length", 64 * MIB),
                ("grpc.max_receive_message_length", 64 * MIB),
            ],
        )
        for _ in range(max(1, scenario.concurrency // 32))
    ]
    stubs = [pb_grpc.ExternalProcessorStub(channel) for channel in channels]
    outcomes: Counter[str] = Counter()
    next_index = 0

    async def worker(stub: pb_grpc.ExternalProcessorStub) -> None:
        nonlocal next_index
        while next_index < scenario.requests:
            index = next_index
            next_index += 1
            outcomes[await one_request(stub, scenario.body, index, hold)] += 1

    try:
        await asyncio.gather(*(worker(stubs[i % len(stubs)]) for i in range(scenario.concurrency)))
    finally:
        for channel in channels:
            await channel.close()
    return outcomes


@dataclass
class Figures:
    scenario: str
    idle_kib: int = 0
    peak_kib: int = 0
    after_kib: int = 0
    child_kib: int = 0
    sampled_peak_kib: int = 0  # policyd + its scraper child, sampled every 20 ms
    seconds: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    log_bytes: int = 0
    timed_out: bool = False


def known_flags(python: str, source: Path) -> str:
    return subprocess.run(
        [python, "-m", "policyd", "serve", "--help"],
        cwd=source,
        env={**os.environ, "PYTHONPATH": str(source)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout


async def measure(
    pid: int, port: int, scenario: Scenario, arguments: argparse.Namespace, figures: Figures
) -> None:
    """Flood the server ``pid`` on ``port`` and note its memory (and its children's)."""
    figures.idle_kib = status_kib(pid, "VmRSS")
    child = children(pid)
    stop_sampling = asyncio.Event()

    async def sample() -> None:
        while not stop_sampling.is_set():
            total = status_kib(pid, "VmRSS") + sum(status_kib(c, "VmRSS") for c in child)
            figures.sampled_peak_kib = max(figures.sampled_peak_kib, total)
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    try:
        figures.outcomes = await asyncio.wait_for(
            flood(port, scenario, arguments.hold), arguments.timeout
        )
    except TimeoutError:
        figures.timed_out = True
    figures.seconds = time.monotonic() - started
    await asyncio.sleep(1.0)
    stop_sampling.set()
    await sampler
    figures.peak_kib = status_kib(pid, "VmHWM")
    figures.after_kib = status_kib(pid, "VmRSS")
    figures.child_kib = sum(status_kib(c, "VmRSS") for c in child)


async def run_noop(scenario: Scenario, arguments: argparse.Namespace, destination: str) -> Figures:
    """The same flood against the no-op Python ext_proc (``overhead.py``'s (b)): the
    floor of any ext_proc on this grpcio, which reads every body whole too."""
    figures = Figures(scenario.name + " no-op")
    port = free_port()
    process = multiprocessing.get_context("spawn").Process(
        target=run_noop_extproc, args=(port, destination), daemon=True
    )
    process.start()
    try:
        wait_for_port(port)
        await asyncio.sleep(1.0)
        assert process.pid is not None
        await measure(process.pid, port, scenario, arguments, figures)
    finally:
        process.terminate()
        process.join()
    return figures


async def run_scenario(
    scenario: Scenario, arguments: argparse.Namespace, pods_file: Path, directory: Path
) -> Figures:
    figures = Figures(scenario.name)
    port = free_port()
    source = Path(arguments.source).resolve()
    argv = [
        sys.executable,
        "-m",
        "policyd",
        "serve",
        "--policy",
        str(source / "rules" / "default.yaml"),
        "--pods",
        str(pods_file),
        "--port",
        str(port),
        "--monitoring-port",
        "0",
        "--grace-seconds",
        "0",
        "--log-level",
        "error",
    ]
    if arguments.max_buffered_body_mib is not None:
        argv += ["--max-buffered-body-mib", str(arguments.max_buffered_body_mib)]
        if arguments.max_buffered_body_mib < 16:  # one body may not exceed the total
            argv += ["--max-body-mib", str(arguments.max_buffered_body_mib)]
    log_path = directory / f"decisions-{scenario.name}.jsonl"
    if scenario.decision_log:
        argv += ["--decision-log", str(log_path)]
    errors = (directory / f"stderr-{scenario.name}.txt").open("w")
    process = subprocess.Popen(
        argv, cwd=source, env={**os.environ, "PYTHONPATH": str(source)}, stderr=errors
    )
    try:
        try:
            wait_for_port(port)
        except RuntimeError:
            errors.flush()
            print((directory / f"stderr-{scenario.name}.txt").read_text(), file=sys.stderr)
            raise
        await policyd_ready(port, 3)
        await asyncio.sleep(1.0)  # the scraper child settles
        await measure(process.pid, port, scenario, arguments, figures)
        if process.poll() is not None:
            figures.outcomes["policyd died"] += 1
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        errors.close()
    if scenario.decision_log and log_path.exists():
        figures.log_bytes = log_path.stat().st_size
    return figures


def mib(kib: int) -> str:
    return f"{kib / 1024:7.1f}"


def report(results: list[Figures], arguments: argparse.Namespace, bound_mib: float) -> None:
    print(
        f"\npolicyd from {Path(arguments.source).resolve()}; "
        f"--max-buffered-body-mib {bound_mib:g}; hold {arguments.hold:g} s; "
        f"memory limit {LIMIT_MIB} MiB"
    )
    print(
        f"{'scenario':14} {'idle MiB':>9} {'peak MiB':>9} {'peak-idle':>9} {'after':>8}"
        f" {'child':>7} {'peak+child':>10} {'sampled':>8} {'secs':>6}  answers"
    )
    for f in results:
        answers = ", ".join(f"{k} x{v}" for k, v in sorted(f.outcomes.items()))
        if f.timed_out:
            answers += " (timed out)"
        if f.log_bytes:
            answers += f"; decision log {f.log_bytes / MIB:.1f} MiB"
        total = f.peak_kib + f.child_kib
        print(
            f"{f.scenario:14} {mib(f.idle_kib):>9} {mib(f.peak_kib):>9}"
            f" {mib(f.peak_kib - f.idle_kib):>9} {mib(f.after_kib):>8} {mib(f.child_kib):>7}"
            f" {mib(total):>10} {mib(f.sampled_peak_kib):>8} {f.seconds:6.1f}  {answers}"
        )
    worst = max(f.peak_kib + f.child_kib for f in results if not f.scenario.endswith("no-op"))
    verdict = "within" if worst < LIMIT_MIB * 1024 else "OVER"
    print(
        f"worst peak of policyd (serving process + scraper child): {worst / 1024:.0f} MiB,"
        f" {verdict} {LIMIT_MIB} MiB"
    )


async def main(arguments: argparse.Namespace) -> None:
    wanted = set(arguments.only.split(",")) if arguments.only else None
    selected = [s for s in scenarios(arguments.rounds) if wanted is None or s.name in wanted]
    source = Path(arguments.source).resolve()
    if arguments.max_buffered_body_mib is not None and "--max-buffered-body-mib" not in known_flags(
        sys.executable, source
    ):
        print(f"{source} has no --max-buffered-body-mib: run without it", file=sys.stderr)
        arguments.max_buffered_body_mib = None
    bound = arguments.max_buffered_body_mib
    if bound is None:
        help_text = known_flags(sys.executable, source)
        bound = 64.0 if "--max-buffered-body-mib" in help_text else float("inf")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    pods = context.Process(target=run_pods, args=(3, queue), daemon=True)
    pods.start()
    try:
        addresses = [f"127.0.0.1:{port}" for port in queue.get(timeout=60)]
        with tempfile.TemporaryDirectory(prefix="policyd-memory-") as temporary:
            directory = Path(temporary)
            pods_file = write_pods_file(directory / "pods.yaml", addresses)
            results = []
            for scenario in selected:
                print(
                    f"{scenario.name}: {scenario.requests} requests,"
                    f" {scenario.concurrency} at once, {len(scenario.body) / 1e6:.1f} MB bodies",
                    flush=True,
                )
                results.append(await run_scenario(scenario, arguments, pods_file, directory))
                if not arguments.no_baseline:
                    results.append(await run_noop(scenario, arguments, addresses[0]))
            report(results, arguments, bound)
    finally:
        pods.terminate()
        pods.join()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="waves of 128 (default 3)")
    parser.add_argument(
        "--hold", type=float, default=1.0, help="seconds a routed stream stays open (default 1)"
    )
    parser.add_argument("--max-buffered-body-mib", type=float, default=None)
    parser.add_argument("--source", default=str(REPO), help="the checkout whose policyd runs")
    parser.add_argument("--no-baseline", action="store_true", help="skip the no-op ext_proc's runs")
    parser.add_argument("--only", default="", help="comma list of scenarios: prompts,models,log")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds a flood may take (default 120)"
    )
    asyncio.run(main(parser.parse_args()))
