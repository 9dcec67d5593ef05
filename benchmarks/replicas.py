"""How policyd scales out: one replica against two, behind one real Envoy, in one run.

    python benchmarks/replicas.py [--pods 100] [--seconds 6] [--rounds 3]
                                  [--concurrency 32,128] [--rate 500] [--rate-seconds 10]

The set-up, on loopback:

- the pods: ``--pods`` fake model servers in one process of their own
  (``overhead.py``'s: each serves a ~38 KB vLLM-shaped metrics page whose
  load changes at every scrape, and answers a completion at once with a
  fixed JSON body), so the model servers cost next to nothing;
- two replicas: ``policyd serve --policy rules/default.yaml --pods FILE``
  as real processes, each scraping every pod every 100 ms in its scraper
  child, as deployed;
- two Envoys (``--concurrency 1``, the generated bootstrap): one with
  ``--policyd-addresses`` naming the first replica ("1 replica"), one
  naming both ("2 replicas"); Envoy spreads the ext_proc streams over the
  policyd hosts it health-checks. The second replica scrapes all through
  the run, so the background load is the same for both configurations.

Measured, for each configuration in interleaved rounds (drift on a shared
machine hits both alike):

- the throughput at saturation: closed-loop clients at each ``--concurrency``
  level, the best level counting (answers other than 200 are counted apart
  and left out);
- the latency at a fixed moderate rate: an open loop at ``--rate`` requests/s,
  each latency counted from the request's scheduled start, so a client that
  falls behind does not hide the wait (p50, p99);
- each policyd serving process's CPU seconds per 1,000 requests it routed
  (``/proc/<pid>/stat``; its routed count from its own
  ``policyd_decisions_total``), at the peak and at the fixed rate. That cost
  sizes replicas on bigger machines: on this 2-core VM Envoy, the load
  generator and the pods compete with policyd for the same two cores, so
  the machine, not policyd, caps two replicas' throughput;
- where the cores went at each peak (each replica, Envoy, the load generator,
  the pods, the whole machine);
- scraping with no traffic: each replica's serving process and scraper child
  in cores per wall second, and the pods process's, with one replica
  scraping and with two.

Printed with the ratios 2 replicas / 1 replica from this run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import EnvoyProcess, free_port, start_envoy

sys.path.insert(0, str(Path(__file__).parent))
from overhead import (  # the serving-overhead benchmark's pods and body
    BODY,
    concurrency_levels,
    policyd_ready,
    run_pods,
    write_pods_file,
)
from processes import children_cpu_seconds, machine_busy_seconds, process_cpu_seconds

REPO = Path(__file__).resolve().parents[1]
HEADERS = {"content-type": "application/json"}
IDLE_SECONDS = 3.0
# Where the CPU goes: each replica's serving process, both scraper children, Envoy,
# this process (the load generator), the pods, and the whole machine.
CPU_COLUMNS = ("replica 1", "replica 2", "scrapers", "envoy", "client", "pods", "machine")


@dataclasses.dataclass
class Replica:
    """One ``policyd serve`` process: its gRPC port and its monitoring port."""

    process: subprocess.Popen[bytes]
    port: int
    monitoring_port: int

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.pid)

    def children_cpu_seconds(self) -> float:
        """Its scraper child's CPU so far."""
        return sum(children_cpu_seconds(self.pid).values())

    async def routed(self, client: aiohttp.ClientSession) -> int:
        """The requests this replica decided so far (routed or answered with an error),
        from its own Prometheus counter."""
        url = f"http://127.0.0.1:{self.monitoring_port}/metrics"
        async with client.get(url) as response:
            text = await response.text()
        return round(
            sum(
                float(line.rpartition(" ")[2])
                for line in text.splitlines()
                if line.startswith("policyd_decisions_total{")
            )
        )


@dataclasses.dataclass
class Phase:
    """One configuration's figures at one load, summed over the rounds."""

    completed: int = 0  # answered 200
    failed: Counter[str] = dataclasses.field(default_factory=Counter)  # by what went wrong
    wall: float = 0.0
    routed: list[int] = dataclasses.field(default_factory=lambda: [0, 0])  # by replica
    cpu: Counter[str] = dataclasses.field(default_factory=Counter)  # seconds, by CPU_COLUMNS
    latencies_ms: list[float] = dataclasses.field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.completed / self.wall if self.wall else 0.0

    def us_per_request(self, replica: int) -> float:
        """The replica's serving-process CPU microseconds per request it routed."""
        routed = self.routed[replica]
        return self.cpu[f"replica {replica + 1}"] / routed * 1e6 if routed else float("nan")

    def cpu_per_1000(self) -> float:
        """The serving processes' CPU seconds per 1,000 requests, over both replicas."""
        routed = sum(self.routed)
        serving = self.cpu["replica 1"] + self.cpu["replica 2"]
        return serving / routed * 1000 if routed else float("nan")

    def cores(self, column: str) -> float:
        """CPU seconds per wall second: a column of CPU_COLUMNS, or "rest", what the
        machine spent on other work (other users, the kernel's network processing)."""
        if column == "rest":
            measured = sum(self.cpu[name] for name in CPU_COLUMNS if name != "machine")
            return (self.cpu["machine"] - measured) / self.wall
        return self.cpu[column] / self.wall

    def percentile(self, share: int) -> float:
        return statistics.quantiles(self.latencies_ms, n=100)[share - 1]


@dataclasses.dataclass
class Configuration:
    """One Envoy in front of the first ``count`` replicas, with its own client session."""

    count: int
    envoy: EnvoyProcess
    session: aiohttp.ClientSession
    saturation: dict[int, Phase] = dataclasses.field(default_factory=dict)  # by concurrency
    fixed_rate: Phase = dataclasses.field(default_factory=Phase)

    @property
    def name(self) -> str:
        return f"{self.count} replica" + ("s" if self.count > 1 else "")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listen_port}/v1/completions"

    @property
    def peak(self) -> tuple[int, Phase]:
        return max(self.saturation.items(), key=lambda item: item[1].rate)

    async def one(self) -> str:
        """How one request went: "200", the status and the JSON error's code, or the
        exception when no answer came."""
        try:
            async with self.session.post(self.url, data=BODY, headers=HEADERS) as response:
                body = await response.read()
                if response.status == 200:
                    return "200"
                try:
                    code = json.loads(body)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = body[:60].decode(errors="replace")
                return f"{response.status} {code}"
        except aiohttp.ClientError as error:
            return type(error).__name__


@dataclasses.dataclass(frozen=True)
class Idle:
    """Cores (CPU seconds per wall second) with no traffic."""

    replicas: list[tuple[float, float]]  # each replica's serving process and scraper child
    pods: float  # the pods process, answering both replicas' scrapes


@dataclasses.dataclass
class Stack:
    """The running processes and clients, and the measurements taken on them."""

    replicas: list[Replica]
    pods_pid: int
    configurations: list[Configuration]
    client: aiohttp.ClientSession  # for policyd's /metrics and Envoy's admin

    @contextlib.asynccontextmanager
    async def measured(self, configuration: Configuration, phase: Phase) -> Any:
        """Adds what every process used over the block, and each replica's routed count."""
        routed = [await replica.routed(self.client) for replica in self.replicas]
        envoy = configuration.envoy.process
        assert envoy is not None
        before = self.cpu_seconds(envoy.pid)
        started = time.perf_counter()
        yield
        phase.wall += time.perf_counter() - started
        phase.cpu.update(self.cpu_seconds(envoy.pid) - before)
        for index, replica in enumerate(self.replicas):
            phase.routed[index] += await replica.routed(self.client) - routed[index]

    def cpu_seconds(self, envoy: int) -> Counter[str]:
        """CPU seconds so far, by CPU_COLUMNS."""
        first, second = self.replicas
        return Counter(
            {
                "replica 1": first.cpu_seconds(),
                "replica 2": second.cpu_seconds(),
                "scrapers": first.children_cpu_seconds() + second.children_cpu_seconds(),
                "envoy": process_cpu_seconds(envoy),
                "client": time.process_time(),
                "pods": process_cpu_seconds(self.pods_pid),
                "machine": machine_busy_seconds(),
            }
        )

    async def saturate(
        self, configuration: Configuration, concurrency: int, seconds: float
    ) -> None:
        phase = configuration.saturation.setdefault(concurrency, Phase())
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                if (status := await configuration.one()) == "200":
                    phase.completed += 1
                else:
                    phase.failed[status] += 1

        async with self.measured(configuration, phase):
            await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def open_loop(self, configuration: Configuration, rate: float, seconds: float) -> None:
        """Requests sent on a clock whatever the answers; latency from the scheduled start."""
        phase = configuration.fixed_rate

        async def send(scheduled: float) -> None:
            if (status := await configuration.one()) == "200":
                phase.completed += 1
                phase.latencies_ms.append((time.perf_counter() - scheduled) * 1000)
            else:
                phase.failed[status] += 1

        tasks = []
        async with self.measured(configuration, phase):
            start = time.perf_counter()
            for index in range(int(rate * seconds)):
                scheduled = start + index / rate
                if (delay := scheduled - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(scheduled)))
            await asyncio.gather(*tasks)

    async def idle(self, seconds: float) -> Idle:
        """Cores each process used over ``seconds`` with no traffic: the scrapes' cost."""
        replicas = self.replicas
        before = [(r.cpu_seconds(), r.children_cpu_seconds()) for r in replicas]
        pods = process_cpu_seconds(self.pods_pid)
        started = time.perf_counter()
        await asyncio.sleep(seconds)
        wall = time.perf_counter() - started
        cores = [
            ((r.cpu_seconds() - serving) / wall, (r.children_cpu_seconds() - child) / wall)
            for r, (serving, child) in zip(replicas, before, strict=True)
        ]
        return Idle(cores, (process_cpu_seconds(self.pods_pid) - pods) / wall)


def start_replica(pods_file: Path, log: Path) -> Replica:
    """``policyd serve`` with its default flags but for free loopback ports and no
    grace period on stop."""
    port, monitoring = free_port(), free_port()
    command = [
        sys.executable, "-m", "policyd", "serve",
        "--policy", str(REPO / "rules" / "default.yaml"), "--pods", str(pods_file),
        "--port", str(port), "--monitoring-port", str(monitoring),
        "--grace-seconds", "0", "--log-level", "warning",
    ]  # fmt: skip
    with log.open("ab") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    return Replica(process, port, monitoring)


async def healthy_hosts(client: aiohttp.ClientSession, envoy: EnvoyProcess) -> int:
    """How many policyd hosts Envoy's health checks mark healthy."""
    async with client.get(f"http://127.0.0.1:{envoy.admin_port}/clusters") as response:
        text = await response.text()
    return sum(
        1
        for line in text.splitlines()
        if line.startswith("policyd::") and line.endswith("::health_flags::healthy")
    )


@contextlib.asynccontextmanager
async def stack(arguments: argparse.Namespace, directory: Path) -> Any:
    """The pods, two replicas, and an Envoy for each configuration; all stopped after."""
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    pods = context.Process(target=run_pods, args=(arguments.pods, ports), daemon=True)
    pods.start()
    replicas: list[Replica] = []
    envoys: list[EnvoyProcess] = []
    try:
        addresses = [f"127.0.0.1:{port}" for port in ports.get(timeout=60)]
        pods_file = write_pods_file(directory / "pods.yaml", addresses)
        replicas = [start_replica(pods_file, directory / f"policyd-{i}.log") for i in range(2)]
        for replica in replicas:
            await policyd_ready(replica.port, arguments.pods)
        async with aiohttp.ClientSession() as client:
            configurations: list[Configuration] = []
            try:
                for count in (1, 2):
                    envoy_directory = directory / f"envoy-{count}"
                    envoy_directory.mkdir()
                    addresses = [f"127.0.0.1:{r.port}" for r in replicas[:count]]
                    options = EnvoyConfigOptions(
                        port=0, admin_port=0, policyd_addresses=tuple(addresses)
                    )
                    envoy = await start_envoy(envoy_directory, options)
                    envoys.append(envoy)
                    deadline = time.monotonic() + 15
                    while await healthy_hosts(client, envoy) < count:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"Envoy did not see {count} healthy policyd hosts")
                        await asyncio.sleep(0.05)
                    connector = aiohttp.TCPConnector(limit=max(arguments.concurrency))
                    session = aiohttp.ClientSession(connector=connector)
                    configurations.append(Configuration(count, envoy, session))
                assert pods.pid is not None
                yield Stack(replicas, pods.pid, configurations, client)
            finally:
                for configuration in configurations:
                    await configuration.session.close()
    finally:
        for envoy in envoys:
            envoy.stop()
        for replica in replicas:
            replica.process.terminate()
            replica.process.wait(10)
        pods.terminate()
        pods.join(10)


async def measure(arguments: argparse.Namespace, running: Stack) -> Idle:
    """The scrape cost with no traffic, then every phase, each visiting the
    configurations in turn."""
    idle = await running.idle(IDLE_SECONDS)
    configurations = running.configurations
    for configuration in configurations:  # connections, code paths and both hosts warm
        for _ in range(100):
            if (status := await configuration.one()) != "200":
                raise RuntimeError(f"{configuration.name}: warm-up answered {status}")
    for _ in range(arguments.rounds):
        for concurrency in arguments.concurrency:
            for configuration in configurations:
                await running.saturate(
                    configuration, concurrency, arguments.seconds / arguments.rounds
                )
    halves = 2  # two turns each, so drift over the fixed-rate phase hits both alike
    for _ in range(halves):
        for configuration in configurations:
            await running.open_loop(configuration, arguments.rate, arguments.rate_seconds / halves)
    return idle


def report(
    arguments: argparse.Namespace,
    configurations: list[Configuration],
    idle: Idle,
) -> None:
    one, two = configurations
    rate = arguments.rate
    print(
        f"{arguments.pods} pods, rules/default.yaml; saturation: best of concurrency "
        f"{', '.join(map(str, arguments.concurrency))}, {arguments.seconds:g} s each in "
        f"{arguments.rounds} rounds; latency at {rate:g} req/s, open loop, "
        f"{arguments.rate_seconds:g} s"
    )
    print(
        f"{'':<12}{'max req/s':>10}{'at':>5}{'p50 ms':>9}{'p99 ms':>9}{'sent/s':>8}"
        f"{'CPU s/1k req peak':>19}{f'at {rate:g}/s':>10}"
    )
    for configuration in configurations:
        level, peak = configuration.peak
        fixed = configuration.fixed_rate
        print(
            f"{configuration.name:<12}{peak.rate:>10.0f}{level:>5}{fixed.percentile(50):>9.2f}"
            f"{fixed.percentile(99):>9.2f}{fixed.rate:>8.0f}{peak.cpu_per_1000():>19.3f}"
            f"{fixed.cpu_per_1000():>10.3f}"
        )
    print("req/s by concurrency: " + ", ".join(map(str, arguments.concurrency)))
    for configuration in configurations:
        rates = "".join(f"{configuration.saturation[c].rate:>8.0f}" for c in arguments.concurrency)
        print(f"{configuration.name:<12}{rates}")
    columns = (*CPU_COLUMNS, "rest")
    print(f"{'cores':<22}" + "".join(f"{column:>10}" for column in columns))
    for configuration in configurations:
        for label, phase in (
            ("peak", configuration.peak[1]),
            (f"{rate:g}/s", configuration.fixed_rate),
        ):
            print(
                f"{f'{configuration.name}, {label}':<22}"
                + "".join(f"{phase.cores(column):>10.2f}" for column in columns)
            )
    for configuration in configurations:
        for label, phase in (
            ("at the peak", configuration.peak[1]),
            (f"at {rate:g}/s", configuration.fixed_rate),
        ):
            shares = ", ".join(
                f"replica {index + 1} routed {phase.routed[index]}, "
                f"{phase.us_per_request(index):.0f} us CPU each"
                for index in range(configuration.count)
            )
            print(f"{configuration.name}, {label}: {shares}")
        failed = [
            f"{dict(phase.failed)} at {where}"
            for where, phase in (
                *((f"concurrency {c}", p) for c, p in configuration.saturation.items()),
                (f"{rate:g}/s", configuration.fixed_rate),
            )
            if phase.failed
        ]
        if failed:
            print(f"{configuration.name}: answers other than 200, not counted: {'; '.join(failed)}")
    (serving_1, child_1), (serving_2, child_2) = idle.replicas
    per_100 = 100 / arguments.pods
    print(
        f"scraping {arguments.pods} pods every 100 ms, no traffic, in cores: replica 1 "
        f"{serving_1:.3f} serving + {child_1:.3f} scraper child, replica 2 {serving_2:.3f} + "
        f"{child_2:.3f}; per replica per 100 pods "
        f"{(serving_1 + child_1 + serving_2 + child_2) / 2 * per_100:.3f}; the pods process "
        f"answering both replicas' scrapes {idle.pods:.3f}"
    )
    (_, peak_1), (_, peak_2) = one.peak, two.peak
    print(
        f"2 replicas / 1 replica (same run): max req/s x{peak_2.rate / peak_1.rate:.2f}, "
        f"p50 at {rate:g}/s x{two.fixed_rate.percentile(50) / one.fixed_rate.percentile(50):.2f}, "
        f"p99 x{two.fixed_rate.percentile(99) / one.fixed_rate.percentile(99):.2f}, "
        f"CPU per request at the peak x{peak_2.cpu_per_1000() / peak_1.cpu_per_1000():.2f}, "
        f"at {rate:g}/s x{two.fixed_rate.cpu_per_1000() / one.fixed_rate.cpu_per_1000():.2f}"
    )
    for configuration in configurations:
        print(
            f"{configuration.name}: a serving process with a core to itself would route "
            f"~{1000 / configuration.peak[1].cpu_per_1000():.0f} req/s at the peak's CPU "
            "per request"
        )


async def main(arguments: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="policyd-replicas-") as temporary:
        async with stack(arguments, Path(temporary)) as running:
            idle = await measure(arguments, running)
        report(arguments, running.configurations, idle)


def positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=100, help="pods every replica scrapes")
    parser.add_argument(
        "--seconds", type=positive, default=6.0, help="saturation per configuration and level"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of saturation")
    parser.add_argument(
        "--concurrency",
        type=concurrency_levels,
        default=[32, 128],
        help="comma-separated client concurrencies; max throughput is the best over them",
    )
    parser.add_argument(
        "--rate", type=positive, default=500.0, help="requests/s of the latency phase"
    )
    parser.add_argument(
        "--rate-seconds", type=positive, default=10.0, help="latency phase per configuration"
    )
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_arguments()))
