"""The live benchmark of record: the real ``policyd serve``, Envoy and simulated pods (issue 31).

    python benchmarks/live.py --workload seed --time-scale 3 --pickers lora-balanced random
    python benchmarks/live.py --quick --time-scale 3            # a small run of everything
    python benchmarks/live.py --workload shared-prefix --virtual --json live.json

Every cell (a picker on a workload, at a load and a time scale) gets a stack
of its own (``live_stack.py``): six simulated pods (``policyd sim --pods 1
--profile --time-scale``, a process each), Envoy from ``policyd
envoy-config`` and ``policyd serve`` with the picker's policy (approximate
prefix index, the pods' tokenizer), on free loopback ports, stopped when the
cell ends; a late scrape or decision on a loaded machine does not turn into
a 503 (``live_stack.py`` says how). The client is aiohttp shaped like the
workload's:

- **seed**: the published client, 1,000 requests at once through a pool of
  100 connections, each naming one of 12 adapters (drawn as the virtual run
  draws them), the published prompt's text, ``max_tokens`` 750, no criticality header,
  300 s per request from its start (the wait for a connection included);
  TTFT from the moment it holds a connection;
- **shared-prefix, multi-turn, mixed** (``policyd/sim/workloads.py``):
  Poisson arrivals for ``--duration`` simulated seconds at the knee and 1.5x
  the knee (``KNEES``, per profile), chat requests with the
  critical header as the virtual runs send it, 120 s per request from its
  send; a chat turn goes its think time after the previous one completes;
- **tenants, priorities**: flow control's workloads at 2x and 3x (tenants)
  or 2x (priorities) the pool's capacity (``CAPACITIES``, per profile;
  ``--multiples`` for others), contenders (``--flow-pickers``) ``none``
  (``rules/default.yaml``), ``flow`` (the same with the flow section of
  ``benchmarks/flow_quality.py``, its waits divided by the time scale),
  ``flow+lora-prefix`` and ``rules/flow.yaml`` (the shipped flow policy, its
  waits divided alike); plus an idle run (a fifth of the capacity, ``none``)
  for the goals' idle TTFT. Only the small tenant's requests are streamed
  under tenants (the flood's are not, to keep the machine's CPU for the pods).
- **slo** (``--profile l4-llama3.1-8b`` only, so not by default):
  ``SloMix``'s interactive, batch and sheddable classes, each with its
  criticality and objective headers (interactive and sheddable streamed,
  batch answered whole), at the knee, the goal's load of ``slo_quality.py``,
  1.5x and 2x the knee (``--slo-loads`` picks some); contenders
  ``lora-prefix`` and ``slo``; per cell each
  class's objectives met and policyd's own count of the objectives it read
  and its prediction error (``slo_quality.live_table``).

``--replicas`` and ``--prefix-index`` run each picker of the seed and prefix
workloads on that many ``policyd serve`` replicas behind the one Envoy, in
that prefix mode (precise: every pod publishes its KV events and every
replica follows them all); a picker on more than one replica, or in precise
mode, is named so (``lora-prefix precise x2``), and each is compared with
the same picker and mode on one replica of the same repeat (issue 34's goal:
hit rate and TTFT p90 within 5%).

Every other request is streamed (TTFT: the first streamed token) and asks for
the usage (output tokens). Arrival times run on the wall clock divided by the
time scale; every figure is in simulated seconds (wall x time scale). The
pickers of a (workload, load, time scale) run in a shuffled order per repeat
(seeded), ``--parallel`` of them side by side, each on its own stack; each
repeat replays the same requests (``--seed``), so the spread is the live
run's own.

Reported per cell, median and range over repeats: completed, output tok/s,
TTFT p50/p90/p99, the pods' prefix-cache hit rate (their
``vllm:prefix_cache_hits_total`` over ``..._queries_total``) and its share
of the workload's ceiling (the share of prompt tokens in full blocks shared
with another request: no router can beat it), the busiest pod's routed
requests over the mean (policyd's ``policyd_decisions_total``), and gains
paired per repeat against ``random`` and ``lora-balanced``; flow control's
goals per cell. ``--virtual`` runs the same requests on the same seed in
virtual time (``quality.py``'s and ``flow_quality.py``'s machinery) and
prints live against virtual. The seed client tells each simulated pod the
output length the virtual run drew for the request (``sim_output_tokens``,
docs/simulator.md), so both serve the same requests; on the other workloads
the pods draw each request's length themselves (capped by ``max_tokens``),
and the virtual twins draw theirs the same way rather than taking
``max_tokens`` as ``quality.py`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol, cast

import aiohttp
import flow_quality
import live_report
import pd_quality
import quality
import slo_quality
import yaml
from live_report import CellRun, Virtual
from live_stack import (
    APPROXIMATE,
    PODS,
    PRECISE,
    PREFIX_TOKENIZER,
    PoolCounters,
    Setup,
    Stack,
    run_open,
    run_seed,
)

from policyd.sim.experiment import SeedWorkload, percentile, seed_requests
from policyd.sim.open_loop import OpenRequest
from policyd.sim.profile import Profile, get_profile
from policyd.sim.workloads import (
    Classes,
    Mixed,
    MultiTurn,
    Priorities,
    RagMix,
    SharedPrefix,
    SloMix,
    Tenants,
)

RULES: Final = Path(__file__).resolve().parents[1] / "rules"
SEED: Final = "seed"
# Per profile, requests/s of simulated time: random routing's knee on each open-loop
# workload (quality.py's sweeps find it; docs/simulator.md gives the figures) and the
# pool's capacity under flow control's workloads (flow_quality.py measures it).
KNEES: Final = {
    "l4-llama2-7b": {"shared-prefix": 1.0, "mixed": 1.0, "multi-turn": 4.0},
    "l4-llama3.1-8b": {"shared-prefix": 7.0, "mixed": 3.5, "multi-turn": 20.0},
}
CAPACITIES: Final = {"l4-llama2-7b": 11.5, "l4-llama3.1-8b": 34.4}
PREFIX: Final[dict[str, Callable[[], SharedPrefix | MultiTurn]]] = {
    "shared-prefix": SharedPrefix,
    "mixed": Mixed,
    "multi-turn": MultiTurn,
}
FLOW: Final[dict[str, Callable[[], Classes]]] = {"tenants": Tenants, "priorities": Priorities}
FLOW_MULTIPLES: Final = {"tenants": (2.0, 3.0), "priorities": (2.0,)}
IDLE: Final = "idle"
SHIPPED_FLOW: Final = flow_quality.SHIPPED_FLOW
FLOW_PICKERS: Final = ("none", "flow", "flow+lora-prefix", SHIPPED_FLOW)
# The SLO workload (issue 35) runs on the V1 profile only (so not by default), its
# contenders lora-prefix and slo (``slo_quality.LIVE_PICKERS``).
SLO: Final = "slo"
# The P/D workload (issue 36), on the V1 profile only: aggregated serving against a pool
# of 1 prefill and 5 decode pods (``pd_quality.LIVE_PICKERS``).
RAG: Final = "rag"
WORKLOADS: Final = (SEED, *PREFIX, *FLOW, SLO, RAG)
OPEN_TIMEOUT_S: Final = 120.0  # simulated, from the send (the virtual runs' client)
QUICK_REQUESTS: Final = 100
QUICK_DURATION_S: Final = 30.0
REPLICA_DRIFT: Final = 0.05  # issue 34: N replicas' hit rate and TTFT p90 within 5% of one's


def shipped_pickers() -> list[str]:
    """Every shipped policy (``rules/*.yaml``, not the tests beside them); random is one."""
    return sorted(p.stem for p in RULES.glob("*.yaml") if not p.name.endswith(".test.yaml"))


class Workload(Protocol):
    def requests(self, *, rate: float, duration_s: float, seed: int) -> tuple[OpenRequest, ...]:
        """Requests arriving at ``rate`` for ``duration_s``, drawn from ``seed``."""


@dataclass(frozen=True, slots=True)
class PodLengths:
    """A workload whose outputs are as long as a simulated pod makes them.

    A pod draws a request's natural length from the profile's range and stops
    at ``max_tokens``; the workloads' ``output_length`` is ``max_tokens``,
    which a live pod cannot be told. The virtual twins draw the same way.
    """

    workload: Workload
    profile: Profile

    def requests(self, *, rate: float, duration_s: float, seed: int) -> tuple[OpenRequest, ...]:
        rng = random.Random(f"pod-lengths-{seed}")
        low, high = self.profile.output_tokens_min, self.profile.output_tokens_max
        return tuple(
            dataclasses.replace(r, output_length=min(rng.randint(low, high), r.max_tokens))
            for r in self.workload.requests(rate=rate, duration_s=duration_s, seed=seed)
        )


@dataclass(frozen=True, slots=True)
class Cell:
    workload: str
    load: str
    rate: float  # requests/s, simulated (0: the seed burst)
    time_scale: float
    picker: str
    repeat: int
    replicas: int = 1
    prefix_index: str = APPROXIMATE

    @property
    def name(self) -> str:
        """The picker as the tables show it: with its prefix mode and replicas when not
        the default's (approximate, one)."""
        return variant(self.picker, self.prefix_index, self.replicas)


def variant(picker: str, prefix_index: str, replicas: int) -> str:
    mode = f" {PRECISE}" if prefix_index == PRECISE else ""
    return f"{picker}{mode}{f' x{replicas}' if replicas > 1 else ''}"


def loads(
    workload: str,
    profile: str = "l4-llama2-7b",
    multiples: Sequence[float] | None = None,
    slo_loads: Sequence[str] | None = None,
    rag_rate: float = pd_quality.GOAL_RATE,
) -> list[tuple[str, float]]:
    """The loads a workload runs at on pods of ``profile``: (label, requests/s of
    simulated time); a flow workload at ``multiples`` of the capacity where given, the
    SLO workload at the ``slo_loads`` named (default: all of them), the RAG workload
    unloaded and at ``rag_rate``."""
    if workload == RAG:
        unloaded = pd_quality.UNLOADED_RATE
        return [(f"{pd_quality.UNLOADED} {unloaded:g}/s", unloaded), (f"{rag_rate:g}/s", rag_rate)]
    if workload == SEED:
        return [("burst", 0.0)]
    if workload == SLO:
        chosen = slo_loads or [name for name, _ in slo_quality.LIVE_LOADS]
        return [(f"{n} {rate:g}/s", rate) for n, rate in slo_quality.LIVE_LOADS if n in chosen]
    if workload in PREFIX:
        knee = KNEES[profile][workload]
        return [(f"knee {knee:g}/s", knee), (f"1.5x knee {knee * 1.5:g}/s", knee * 1.5)]
    capacity = CAPACITIES[profile]
    idle = [(IDLE, capacity * flow_quality.IDLE_SHARE)]
    return idle + [(f"{m:g}x", capacity * m) for m in multiples or FLOW_MULTIPLES[workload]]


def plan(arguments: argparse.Namespace) -> list[list[Cell]]:
    """The cells in the order they run, in batches of ``--parallel``: per repeat, time
    scale, workload and load, the pickers shuffled (seeded by the repeat)."""
    batches: list[list[Cell]] = []
    for repeat in range(arguments.repeats):
        for scale in arguments.time_scale:
            for workload in arguments.workload:
                for load, rate in loads(
                    workload,
                    arguments.profile,
                    arguments.multiples,
                    arguments.slo_loads,
                    arguments.rag_rate,
                ):
                    if workload in FLOW:
                        contenders = [FLOW_PICKERS[0]] if load == IDLE else arguments.flow_pickers
                        cells = [Cell(workload, load, rate, scale, p, repeat) for p in contenders]
                    elif workload == RAG:
                        contenders = (
                            [pd_quality.LIVE_AGGREGATED]
                            if load.startswith(pd_quality.UNLOADED)
                            else pd_quality.LIVE_PICKERS
                        )
                        cells = [Cell(workload, load, rate, scale, p, repeat) for p in contenders]
                    elif workload == SLO:
                        cells = [
                            Cell(workload, load, rate, scale, p, repeat)
                            for p in slo_quality.LIVE_PICKERS
                        ]
                    else:
                        cells = [
                            Cell(workload, load, rate, scale, p, repeat, replicas, index)
                            for p in arguments.pickers
                            for index in arguments.prefix_index
                            for replicas in arguments.replicas
                        ]
                    order = random.Random(f"{arguments.seed}-{repeat}-{scale}-{workload}-{load}")
                    order.shuffle(cells)
                    for i in range(0, len(cells), arguments.parallel):
                        batches.append(cells[i : i + arguments.parallel])
    return batches


def seed_workload(arguments: argparse.Namespace) -> SeedWorkload:
    return SeedWorkload(requests=QUICK_REQUESTS if arguments.quick else 1000)


def seed_adapters(workload: SeedWorkload, seed: int) -> list[str]:
    """Each request's adapter, drawn as ``policyd.sim.experiment``'s run draws it."""
    return seed_requests(workload, seed)[0]


def open_requests(cell: Cell, arguments: argparse.Namespace) -> tuple[OpenRequest, ...]:
    workload: Workload = (
        SloMix()
        if cell.workload == SLO
        else RagMix()
        if cell.workload == RAG
        else PREFIX[cell.workload]()
        if cell.workload in PREFIX
        else FLOW[cell.workload]()
    )
    return workload.requests(rate=cell.rate, duration_s=arguments.duration, seed=arguments.seed)


def policy_of(picker: str, cell: Cell, directory: Path) -> Path:
    """The policy file a picker runs: a shipped one, one with the flow section, or
    ``rules/pd.yaml`` at another ``split_at``."""
    if cell.workload == RAG and picker not in (pd_quality.LIVE_AGGREGATED, pd_quality.LIVE_SHIPPED):
        split_at = pd_quality.live_split_at(picker)
        assert split_at is not None
        return pd_quality.pd_policy(split_at, directory)
    if cell.workload not in FLOW:
        return RULES / f"{picker}.yaml"
    if picker == FLOW_PICKERS[0]:
        return RULES / "default.yaml"
    if picker == SHIPPED_FLOW:
        return shipped_flow(cell.time_scale, directory)
    base = RULES / ("lora-prefix.yaml" if picker.endswith("lora-prefix") else "default.yaml")
    return Path(flow_quality.flow_policy(base, directory, flow_quality.SATURATED, cell.time_scale))


def shipped_flow(time_scale: float, directory: Path) -> Path:
    """``rules/flow.yaml`` with its bands' waits divided by ``time_scale`` (pods that
    run that much faster), written to ``directory``."""
    policy = yaml.safe_load((RULES / "flow.yaml").read_text())
    for band in policy["flow"]["bands"].values():
        band["max_wait"] = f"{float(band['max_wait'].removesuffix('s')) / time_scale:g}s"
    path = directory / "flow.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return path


async def run_cell(cell: Cell, arguments: argparse.Namespace, directory: Path) -> CellRun:
    profile = get_profile(arguments.profile)
    flow = cell.workload in FLOW
    timeout = SeedWorkload().timeout_s if cell.workload == SEED else OPEN_TIMEOUT_S
    directory.mkdir(parents=True, exist_ok=True)
    setup = Setup(
        policy_of(cell.picker, cell, directory),
        cell.time_scale,
        arguments.profile,
        arguments.seed,
        timeout,
        replicas=cell.replicas,
        prefix_index=cell.prefix_index,
        roles=pd_quality.roles(pd_quality.PREFILL_PODS)
        if cell.workload == RAG and cell.picker != pd_quality.LIVE_AGGREGATED
        else (),
    )
    counters = PoolCounters()
    began = time.monotonic()
    async with Stack(setup, directory) as stack:
        if cell.workload == SEED:
            workload = seed_workload(arguments)
            adapters, lengths = seed_requests(workload, arguments.seed, profile)
            outcomes, ended = await run_seed(
                stack.url, workload, adapters, cell.time_scale, lengths
            )
            prompts: list[tuple[str, Sequence[int]]] = [(a, workload.prompt) for a in adapters]
            window, rule = 0.0, "completed"
        else:
            requests = open_requests(cell, arguments)
            streamed = [
                cell.workload != "tenants" or r.group == live_report.SMALL_TENANT for r in requests
            ]
            if cell.workload == SLO:
                streamed = [SloMix().of(r.group).streamed for r in requests]
            if cell.workload == RAG:
                streamed = [True] * len(requests)  # every answer streams (issue 36)
            outcomes, ended = await run_open(
                stack.url,
                requests,
                base_model=profile.base_model,
                time_scale=cell.time_scale,
                timeout_s=timeout,
                streamed=streamed,
                critical_default=not flow,
                watch=stack if flow else None,
                counters=counters,
                headers=(lambda group: SloMix().of(group).headers())
                if cell.workload == SLO
                else None,
                exact_lengths=cell.workload == RAG,
            )
            prompts = [
                (r.adapter or profile.base_model, r.prompt)
                for r, o in zip(requests, outcomes, strict=True)
                if o.sent is not None
            ]
            window, rule = arguments.duration / cell.time_scale, "first" if flow else "sent"
        async with aiohttp.ClientSession() as session:
            seen = await stack.counters(session)
        counters.prefix_hits, counters.prefix_queries = seen.prefix_hits, seen.prefix_queries
        counters.routed = seen.routed
        counters.scrapes, counters.failed_scrapes = seen.scrapes, seen.failed_scrapes
        counters.pod_finished, counters.pod_tokens = seen.pod_finished, seen.pod_tokens
        counters.peak_rss_kb = stack.peak_rss_kb()
        slo = {}
        if cell.workload == SLO:
            slo = slo_quality.live_figures(outcomes, cell.time_scale, SloMix())
            (replica,) = stack.replicas  # an SLO cell runs one policyd: its models learn alone
            slo.update(await slo_quality.live_policyd_figures(replica.monitoring_port))
        pd = {}
        if cell.workload == RAG:
            pd = pd_quality.live_figures(outcomes, cell.time_scale)
            (replica,) = stack.replicas
            pd.update(await pd_quality.live_policyd_figures(replica.monitoring_port))
    run = live_report.cell_run(
        key=(cell.workload, cell.load, cell.rate, cell.time_scale, cell.name, cell.repeat),
        outcomes=outcomes,
        ended_s=ended,
        window_s=window,
        counters=counters,
        ceiling_rate=live_report.ceiling(prompts, profile.block_size),
        rule=rule,
        pods=PODS,
        flow=flow,
        wall_s=time.monotonic() - began,
    )
    return dataclasses.replace(run, slo=slo, pd=pd)


# --- the virtual twins ----------------------------------------------------------------------


def virtual_twin(cell: Cell, arguments: argparse.Namespace, directory: Path) -> Virtual:
    """The cell's requests on the same seed in virtual time, routed by the real ``Router``."""
    seed = arguments.seed
    profile = quality.PROFILE
    if cell.workload == SEED:
        result = quality.run_policy(
            RULES / f"{cell.picker}.yaml",
            seed,
            workload=seed_workload(arguments),
            headers={},  # the published client sends no criticality
            tokenizer=PREFIX_TOKENIZER,
        )
        generated = sum(r.output_tokens for r in result.records)
        return Virtual(result.completed, percentile(result.ttft_s(), 0.9), generated)
    if cell.workload in PREFIX:
        lengths = cast(SharedPrefix, PodLengths(PREFIX[cell.workload](), profile))  # duck-typed
        workload = quality.OpenWorkload(cell.workload, lengths, (cell.rate,))
        contender = quality.Contender(
            cell.name, RULES / f"{cell.picker}.yaml", cell.prefix_index, cell.replicas
        )
        run = quality.run_contender(
            contender, workload, rate=cell.rate, duration_s=arguments.duration, seed=seed
        )
        generated = sum(r.output_tokens for r in run.records)
        return Virtual(run.completed, live_report.tail_percentile(run.ttft_s(), 0.9), generated)
    virtual_cell = dataclasses.replace(cell, time_scale=1.0)
    flow_contender = flow_quality.Contender(
        cell.picker,
        policy_of(cell.picker, virtual_cell, directory),
        prefix=cell.picker in FLOW_PICKERS[2:],  # lora-prefix's scorers read the prefix
    )
    classes = cast(Classes, PodLengths(FLOW[cell.workload](), profile))  # duck-typed
    figures = flow_quality.run_one(flow_contender, classes, cell.rate, arguments.duration, seed)
    streamed = figures.classes.get(live_report.SMALL_TENANT) if cell.workload == "tenants" else None
    return Virtual(figures.total.completed, (streamed or figures.total).ttft_p90)


# --- main -----------------------------------------------------------------------------------


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload", nargs="+", choices=WORKLOADS,
        default=[w for w in WORKLOADS if w not in (SLO, RAG)],
    )  # fmt: skip
    parser.add_argument(
        "--time-scale", type=float, nargs="+", default=[0.5, 1.0, 3.0],
        help="simulated seconds per wall second, each a run of its own (default 0.5 1 3)",
    )  # fmt: skip
    parser.add_argument(
        "--pickers", nargs="+", help="policies of rules/ for seed and the prefix workloads "
        "(default: every shipped one; flow workloads run none, flow and flow+lora-prefix)",
    )  # fmt: skip
    parser.add_argument(
        "--flow-pickers", nargs="+", choices=FLOW_PICKERS, default=list(FLOW_PICKERS),
        help="the flow workloads' contenders (default: all; none is the reference)",
    )  # fmt: skip
    parser.add_argument(
        "--multiples", type=float, nargs="+",
        help="the flow workloads' loads, multiples of the capacity (default: 2 3 for "
        "tenants, 2 for priorities)",
    )  # fmt: skip
    parser.add_argument(
        "--replicas", type=int, nargs="+", default=[1],
        help="policyd replicas behind Envoy, each a run of its own (seed and prefix "
        "workloads; default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-index", nargs="+", choices=(APPROXIMATE, PRECISE), default=[APPROXIMATE],
        help="policyd's prefix index, each a run of its own (seed and prefix workloads; "
        "default approximate)",
    )  # fmt: skip
    parser.add_argument(
        "--slo-loads", nargs="+", choices=[name for name, _ in slo_quality.LIVE_LOADS],
        help="the SLO workload's loads (default: all, the knee to 2x)",
    )  # fmt: skip
    parser.add_argument(
        "--rag-rate", type=float, default=pd_quality.GOAL_RATE,
        help=f"the RAG workload's load, requests/s (default {pd_quality.GOAL_RATE:g})",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="default 3")
    parser.add_argument("--parallel", type=int, default=1, help="cells side by side (default 1)")
    parser.add_argument(
        "--duration", type=float, help="simulated seconds of arrivals, open-loop workloads "
        f"(default 200; {QUICK_DURATION_S:g} with --quick)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=100, help="the workload's and pods' seed")
    parser.add_argument(
        "--profile", default="l4-llama2-7b", help="the simulated pods' (policyd sim --profile)"
    )
    parser.add_argument(
        "--quick", action="store_true",
        help=f"a small run for development: seed {QUICK_REQUESTS} requests, "
        f"{QUICK_DURATION_S:g} s of arrivals",
    )  # fmt: skip
    parser.add_argument("--virtual", action="store_true", help="also run the virtual twins")
    parser.add_argument("--json", type=Path, help="write every raw figure here")
    parser.add_argument("--logs", type=Path, help="keep each cell's process logs here")
    arguments = parser.parse_args(argv)
    if arguments.pickers is None:
        arguments.pickers = shipped_pickers()
    unknown = sorted(set(arguments.pickers) - set(shipped_pickers()))
    if unknown:
        parser.error(f"no such policy in rules/: {', '.join(unknown)}")
    if arguments.duration is None:
        arguments.duration = QUICK_DURATION_S if arguments.quick else 200.0
    if FLOW_PICKERS[0] not in arguments.flow_pickers:
        parser.error(f"--flow-pickers needs {FLOW_PICKERS[0]}, the reference of the goals")
    if arguments.multiples is not None and any(m <= 0 for m in arguments.multiples):
        parser.error("--multiples must be positive")
    if arguments.repeats < 1 or arguments.parallel < 1 or min(arguments.replicas) < 1:
        parser.error("--repeats, --parallel and --replicas must be at least 1")
    if arguments.duration <= 0 or any(s <= 0 for s in arguments.time_scale):
        parser.error("--duration and --time-scale must be positive")
    if arguments.profile not in KNEES:
        parser.error(f"--profile must be one of {', '.join(KNEES)}, not {arguments.profile}")
    for workload, profile, twin in (
        (SLO, slo_quality.PROFILE.name, "slo_quality.py"),
        (RAG, pd_quality.PROFILE.name, "pd_quality.py"),
    ):
        if workload in arguments.workload and arguments.profile != profile:
            parser.error(f"--workload {workload} runs on --profile {profile}")
        if arguments.virtual and workload in arguments.workload:
            parser.error(f"--virtual has no twin for --workload {workload}: see {twin}")
    if arguments.virtual and arguments.profile != quality.PROFILE.name:
        parser.error(f"--virtual needs --profile {quality.PROFILE.name} (the virtual runs')")
    return arguments


def report(runs: Sequence[CellRun]) -> list[str]:
    """Every table: the seed and prefix workloads, then flow control's with its goals."""
    lines: list[str] = []
    groups = live_report.grouped(runs)
    for group, pickers in sorted(groups.items()):
        workload, load, scale = group
        if load == IDLE or load.startswith(pd_quality.UNLOADED):
            continue
        if workload == RAG:
            unloaded = [
                run
                for (w, unloaded_load, s), found in groups.items()
                if (w, s) == (workload, scale) and unloaded_load.startswith(pd_quality.UNLOADED)
                for run in found.get(pd_quality.LIVE_AGGREGATED, [])
            ]
            lines += pd_quality.live_table(group, pickers, unloaded)
        elif workload == SLO:
            lines += slo_quality.live_table(group, pickers)
        elif workload in FLOW:
            idle = groups.get((workload, IDLE, scale), {}).get(FLOW_PICKERS[0], [])
            lines += live_report.flow_table(group, pickers, idle)
            lines += ["", *live_report.flow_goals(group, pickers, idle)]
        else:
            lines += live_report.table(group, pickers)
            lines += replica_goals(group, pickers)
        lines.append("")
    return lines


def replica_goals(group: live_report.Group, pickers: dict[str, list[CellRun]]) -> list[str]:
    """Issue 34's goal per picker on several replicas: its hit rate and TTFT p90 over the
    same picker's and prefix mode's on one replica, paired per repeat (median (min-max))."""
    lines: list[str] = []
    for name, mine in sorted(pickers.items()):
        picker, _, replicas = name.rpartition(" x")
        if not picker or not replicas.isdigit() or picker not in pickers:
            continue
        hits = live_report.paired(mine, pickers[picker], lambda r: r.hit_rate)
        p90 = live_report.paired(mine, pickers[picker], lambda r: r.ttft_p90)
        met = hits.low >= 1 - REPLICA_DRIFT and p90.high <= 1 + REPLICA_DRIFT
        lines.append(
            f"{group[0]} {group[1]} x{group[2]:g}: {name} / {picker}: hit rate "
            f"{hits.show('.3f')}x, TTFT p90 {p90.show('.3f')}x (goal both within "
            f"{REPLICA_DRIFT:.0%}): {'met' if met else 'missed'}"
        )
    return lines


def load_average() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def cell_directory(cell: Cell) -> str:
    """A file name for the cell's logs: its workload, load, time scale, picker and repeat."""
    name = f"{cell.workload}-{cell.load}-x{cell.time_scale:g}-{cell.name}-{cell.repeat}"
    return name.replace(" ", "_").replace("/", "per")


async def main_async(arguments: argparse.Namespace, directory: Path) -> list[CellRun]:
    runs: list[CellRun] = []
    batches = plan(arguments)
    cells = sum(len(b) for b in batches)
    done = 0
    for batch in batches:
        started = time.monotonic()
        found = await asyncio.gather(
            *(run_cell(cell, arguments, directory / cell_directory(cell)) for cell in batch)
        )
        runs += found
        done += len(batch)
        for run in found:
            print(
                f"  [{done}/{cells}] {run.workload} {run.load} x{run.time_scale:g} {run.picker} "
                f"#{run.repeat}: {run.completed}/{run.offered} completed, TTFT p90 "
                f"{run.ttft_p90:.2f} s, {run.wall_s:.0f} s wall, {run.failed_scrapes:.1%} of "
                f"the scrapes failed; not served: {run.answers or 0}",
                flush=True,
            )
        print(f"    batch in {time.monotonic() - started:.0f} s; {load_average()}", flush=True)
    return runs


def main(argv: Sequence[str] | None = None) -> list[str]:
    arguments = parse(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    began = time.monotonic()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {load_average()}", flush=True)
    with contextlib.ExitStack() as cleanup:
        if arguments.logs is None:
            directory = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="live-")))
        else:
            directory = arguments.logs
            directory.mkdir(parents=True, exist_ok=True)
        runs = asyncio.run(main_async(arguments, directory))
        lines = [
            f"{PODS} simulated pods ({arguments.profile}), seed {arguments.seed}, "
            f"{arguments.repeats} repeat(s), {arguments.parallel} cell(s) at a time; "
            f"{time.monotonic() - began:.0f} s of wall time; {load_average()}",
            "",
            *report(runs),
        ]
        twins: dict[tuple[str, str, str], Virtual] = {}
        if arguments.virtual:
            for cell in (cell for batch in plan(arguments) for cell in batch):
                key = (cell.workload, cell.load, cell.name)
                if cell.workload == SEED and cell.name != cell.picker:
                    continue  # the virtual seed run has one approximate router
                if key not in twins:
                    twins[key] = virtual_twin(cell, arguments, directory)
            lines += ["live against virtual time, the same requests and seed:", ""]
            lines += live_report.agreement(runs, twins)
    for line in lines:
        print(line)
    if arguments.json is not None:
        arguments.json.write_text(
            json.dumps(
                {
                    "arguments": {
                        k: str(v) if isinstance(v, Path) else v for k, v in vars(arguments).items()
                    },
                    "runs": [dataclasses.asdict(r) for r in runs],
                    "virtual": [
                        {"workload": w, "load": load, "picker": p, **dataclasses.asdict(v)}
                        for (w, load, p), v in twins.items()
                    ],
                },
                indent=1,
            )
        )
    return lines


if __name__ == "__main__":
    main()
