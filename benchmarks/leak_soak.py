"""Whether policyd's memory stays flat under sustained load, through the real Envoy.

    python benchmarks/leak_soak.py [--minutes 6] [--concurrency 16] [--pods 100]
                                   [--graceful-close]

The set-ups are ``overhead.py``'s (b) and (c): Envoy + the no-op Python
ext_proc, and Envoy + policyd with ``rules/default.yaml`` over ``--pods``
simulated pods whose metrics change at every scrape. Each Envoy runs the
bootstrap ``policyd envoy-config`` generates. The run alternates 15-second
load phases between the two for ``--minutes`` and samples each ext_proc
process's resident memory (and the scraper child's) after every phase.

Printed: each process's resident memory over time and the file
descriptors it (and policyd's scraper child) holds at the first and last
phase, then its growth per request, a least-squares slope over the phases
after the first minute (start-up caches and arenas fill in the first), next
to the no-op's. A service that leaks shows a slope that stays positive
however long the run; one that only fills bounded caches levels off.

With the generated bootstrap Envoy resets each ext_proc stream as its request
ends. The no-op reads its stream until Envoy ends it, so the reset cancels a
pending read, which grpcio leaks (grpc/grpc#43360): its slope is that leak.
policyd ends each stream itself once it has answered the last message, so no
read is pending (docs/serving.md, "How Envoy ends a stream").
``--graceful-close`` turns on Envoy's experimental runtime guard
``ext_proc_graceful_grpc_close`` (the bootstrap pins it off: it crashed
Envoy 1.40): Envoy then half-closes and waits for the server's status, and
neither leaks. The guard is read when Envoy loads its configuration.
``benchmarks/soak.py`` soaks the whole stack with long generations.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from overhead import SetUp, policyd_ready, start_envoy, start_processes, stop_all
from processes import children_cpu_seconds

from policyd.extproc.envoy_config import GRACEFUL_CLOSE_FLAG

PHASE_SECONDS = 15.0
WARM_UP_SECONDS = 60.0


def open_files(pid: int) -> int:
    """How many file descriptors a process holds (sockets included)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def resident_kib(pid: int) -> int:
    """A process's resident set size in KiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


@dataclass
class Samples:
    """One set-up's memory after each phase: (seconds into the run, requests so far, KiB),
    and the file descriptors its process and its children (policyd's scraper) hold."""

    name: str
    pid: int
    points: list[tuple[float, int, int]] = field(default_factory=list)
    child_kib: list[int] = field(default_factory=list)
    files: list[tuple[int, int]] = field(default_factory=list)  # (process, children)

    def bytes_per_request(self) -> float:
        """Least-squares growth of resident memory per request, after the warm-up."""
        kept = [(n, kib * 1024) for t, n, kib in self.points if t >= WARM_UP_SECONDS]
        if len(kept) < 3:
            raise RuntimeError("too short a run to fit a slope: raise --minutes")
        return statistics.linear_regression(*zip(*kept, strict=True)).slope


async def soak(arguments: argparse.Namespace) -> list[Samples]:
    settings = argparse.Namespace(
        pods=arguments.pods,
        profile=None,
        scrape_in_process=False,
        naive=False,
        pick_first=False,
        tracing=False,
    )
    with tempfile.TemporaryDirectory(prefix="policyd-soak-") as temporary:
        directory = Path(temporary)
        processes = start_processes(settings, directory)
        set_ups: list[SetUp] = []
        try:
            await policyd_ready(processes.ports["c"], len(processes.pods))
            first = processes.pods[0]
            runtime = {GRACEFUL_CLOSE_FLAG: True} if arguments.graceful_close else None
            for key, name in (("b", "(b) no-op ext_proc"), ("c", "(c) policyd")):
                port, pid = processes.ports[key], processes.pid(key)
                set_ups.append(start_envoy(name, directory, port, first, pid, runtime=runtime))
            samples = [
                Samples(s.name, processes.pid(k)) for s, k in zip(set_ups, "bc", strict=True)
            ]
            for set_up in set_ups:
                await set_up.envoy.wait_ready()
                connector = aiohttp.TCPConnector(limit=arguments.concurrency)
                set_up.session = aiohttp.ClientSession(connector=connector)
            started = time.monotonic()
            deadline = started + arguments.minutes * 60
            while time.monotonic() < deadline:
                for set_up, sample in zip(set_ups, samples, strict=True):
                    await set_up.saturate(PHASE_SECONDS, arguments.concurrency)
                    done = set_up.loads[arguments.concurrency].completed
                    elapsed = time.monotonic() - started
                    sample.points.append((elapsed, done, resident_kib(sample.pid)))
                    children = children_cpu_seconds(sample.pid)
                    sample.child_kib.extend(resident_kib(child) for child in children)
                    held = sum(open_files(child) for child in children)
                    sample.files.append((open_files(sample.pid), held))
        finally:
            await stop_all(set_ups, processes)
    return samples


def report(samples: list[Samples], arguments: argparse.Namespace) -> None:
    close = (
        "half-closed by Envoy (graceful close on)" if arguments.graceful_close else "reset by Envoy"
    )
    print(
        f"{arguments.minutes:g} min at concurrency {arguments.concurrency}, "
        f"{PHASE_SECONDS:g} s phases in turn, ext_proc streams {close}"
    )
    print(f"{'set-up':<22} {'requests':>9} {'RSS first':>10} {'RSS last':>9}  B/request")
    slopes = {}
    for sample in samples:
        _, requests, last = sample.points[-1]
        after_warm_up = [kib for t, _, kib in sample.points if t >= WARM_UP_SECONDS]
        slopes[sample.name] = slope = sample.bytes_per_request()
        print(
            f"{sample.name:<22} {requests:>9} {after_warm_up[0] / 1024:>8.1f}MB "
            f"{last / 1024:>7.1f}MB  {slope:+.1f}"
        )
        print(
            "  RSS (MB) after each phase: " + " ".join(f"{k / 1024:.1f}" for *_, k in sample.points)
        )
        if sample.child_kib:
            print(
                f"  scraper child RSS: {sample.child_kib[0] / 1024:.1f} -> "
                f"{sample.child_kib[-1] / 1024:.1f} MB"
            )
        (first, first_children), (end, end_children) = sample.files[0], sample.files[-1]
        print(
            f"  open file descriptors: {first} -> {end}"
            + (f" (children: {first_children} -> {end_children})" if sample.child_kib else "")
        )
    noop, policyd = (s.name for s in samples)
    print(
        f"growth per request, policyd - no-op: {slopes[policyd] - slopes[noop]:+.1f} B "
        f"(per million requests: {(slopes[policyd] - slopes[noop]):+.1f} MB)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--pods", type=int, default=100, help="pods policyd scrapes and routes to")
    parser.add_argument(
        "--graceful-close",
        action="store_true",
        help="turn on Envoy's experimental ext_proc_graceful_grpc_close (crashed Envoy 1.40)",
    )
    options = parser.parse_args()
    report(asyncio.run(soak(options)), options)
