"""``policyd demo``: the command line (see the package docstring for what runs)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from policyd.demo.feed import DecisionFeed
from policyd.demo.stack import Stack, StackSettings
from policyd.demo.traffic import WORKLOADS, Traffic, TrafficPlan, TrafficResults
from policyd.demo.view import View, comparison, run_figures, summary
from policyd.extproc.envoy_process import EnvoyError
from policyd.policy import PolicyError, PolicyStore
from policyd.prefix.options import MODES
from policyd.sim import L4_LLAMA2_7B, adapter_names

EXIT_INTERRUPTED = 130
DEFAULT_POLICY = "lora-prefix.yaml"
BASELINE_POLICY = "random.yaml"


def shipped_policy(name: str) -> Path:
    """``rules/<name>`` of the checkout policyd runs from, else of the working directory."""
    beside_package = Path(__file__).resolve().parents[2] / "rules" / name
    return beside_package if beside_package.is_file() else Path("rules") / name


def register(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"policy file or directory (default: the checkout's rules/{DEFAULT_POLICY})",
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="mixed",
        help="mixed: LoRA adapters and long shared system prompts; shared-prefix: the "
        "prompts, base model only; lora: short prompts for the adapters (default mixed)",
    )
    parser.add_argument(
        "--prefix-index",
        choices=MODES,
        default="approximate",
        help="how policyd learns what the pods cached: approximate, from its own routing; "
        "precise, from the pods' KV-cache events (default approximate)",
    )
    parser.add_argument(
        "--requests", type=int, default=200, metavar="N", help="requests to send (default 200)"
    )
    parser.add_argument(
        "--continuous",
        action="store_true",
        help="keep sending until Ctrl-C (ignores --requests; no baseline)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip replaying the traffic with uniform random routing for the comparison",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=12.0,
        metavar="PER_SECOND",
        help="average arrivals per second (default 12)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=48,
        metavar="N",
        help="requests open at once at most (default 48)",
    )
    parser.add_argument("--pods", type=int, default=6, help="simulated pods (default 6)")
    parser.add_argument("--adapters", type=int, default=12, help="LoRA adapters (default 12)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=5.0,
        help="simulated time runs this many times faster than the clock (default 5)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the traffic and the pods")
    parser.add_argument(
        "--plain",
        action="store_true",
        help="print one line per request even on a terminal (default: a live table there)",
    )
    parser.set_defaults(run=run)


def run(arguments: argparse.Namespace) -> int:
    problem = _check(arguments)
    if problem:
        print(f"policyd demo: {problem}", file=sys.stderr)
        return 2
    policy = arguments.policy or shipped_policy(DEFAULT_POLICY)
    try:
        store = PolicyStore.open(policy)
        skip = arguments.no_baseline or arguments.continuous
        baseline = None if skip else PolicyStore.open(shipped_policy(BASELINE_POLICY))
    except PolicyError as error:
        print(f"policyd demo: the policy does not load:\n{error}", file=sys.stderr)
        return 1
    return asyncio.run(_demo(arguments, store, baseline))


def _check(arguments: argparse.Namespace) -> str:
    if arguments.requests < 1 or arguments.max_in_flight < 1:
        return "--requests and --max-in-flight must be at least 1"
    if arguments.pods < 1 or arguments.adapters < 1:
        return "--pods and --adapters must be at least 1"
    if not arguments.rate > 0 or not arguments.time_scale > 0:
        return "--rate and --time-scale must be positive"
    if arguments.policy is not None and not arguments.policy.exists():
        return f"--policy {arguments.policy}: no such file or directory"
    return ""


@dataclass
class Run:
    """One policy's run of the traffic: what policyd saw, what the clients saw."""

    policy: str
    feed: DecisionFeed
    traffic: TrafficResults
    seconds: float
    pod_names: list[str]


async def _demo(
    arguments: argparse.Namespace, store: PolicyStore, baseline: PolicyStore | None
) -> int:
    out = sys.stdout
    view = View(out, live=out.isatty() and not arguments.plain)
    root = logging.getLogger()
    root.addHandler(view.log if view.live else logging.StreamHandler(sys.stderr))
    root.setLevel(logging.WARNING)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)

    settings = StackSettings(
        pods=arguments.pods,
        adapters=arguments.adapters,
        time_scale=arguments.time_scale,
        seed=arguments.seed,
        prefix_index=arguments.prefix_index,
    )
    plan = TrafficPlan(
        adapters=adapter_names(arguments.adapters),
        base_model=L4_LLAMA2_7B.base_model,
        workload=arguments.workload,
        requests=None if arguments.continuous else arguments.requests,
        rate=arguments.rate,
        max_in_flight=arguments.max_in_flight,
        seed=arguments.seed,
    )
    print(
        f"policyd demo: starting {arguments.pods} simulated vLLM pods "
        f"({L4_LLAMA2_7B.base_model}, {arguments.adapters} LoRA adapters), policyd and Envoy ...",
        flush=True,
    )
    try:
        main = await _run(settings, store, plan, stopping, view, table=True)
    except (EnvoyError, OSError, RuntimeError) as error:
        print(f"policyd demo: could not start: {error}", file=sys.stderr)
        return 1
    runs = [main]
    if baseline is not None and not stopping.is_set():
        print(
            f"\npolicyd demo: replaying the same {arguments.requests} requests on fresh pods "
            f"with uniform random routing ({shipped_policy(BASELINE_POLICY)}) to compare ...",
            flush=True,
        )
        try:
            replay = await _run(settings, baseline, plan, stopping, view, table=False)
        except (EnvoyError, OSError, RuntimeError) as error:
            print(f"policyd demo: the baseline could not start: {error}", file=sys.stderr)
        else:
            if not stopping.is_set():  # a replay cut short compares with nothing
                runs.append(replay)
    print()
    for line in summary(main.feed, main.traffic, seconds=main.seconds, pod_names=main.pod_names):
        print(line)
    if len(runs) == 2:
        print(
            f"what policyd gained: the same {main.traffic.finished} requests, routed by "
            f"{main.policy} and, on fresh pods, uniformly at random"
        )
    figures = [run_figures(r.policy, r.feed, r.traffic, r.pod_names, plan.adapters) for r in runs]
    for line in comparison(figures, time_scale=arguments.time_scale):
        print(line)
    if stopping.is_set():
        print("policyd demo: interrupted; everything is stopped")
        return EXIT_INTERRUPTED
    ok = main.traffic.statuses.get(200, 0)
    return 0 if ok else 1


async def _run(
    settings: StackSettings,
    store: PolicyStore,
    plan: TrafficPlan,
    stopping: asyncio.Event,
    view: View,
    *,
    table: bool,
) -> Run:
    """Start a fresh stack under ``store``, send ``plan``'s traffic, stop the stack.

    With ``table`` the view draws the run as it goes (the main run); without,
    it shows only how far the run is (the baseline).
    """
    feed = DecisionFeed()
    stack = Stack(settings, feed)
    await stack.start(store)
    traffic = Traffic(stack.url, plan)
    policy = ", ".join(p.name for p in store.current.policies)
    started = time.monotonic()
    try:
        if not table:
            await view.follow(traffic.run(stopping), traffic.results, plan.requests)
            stack.settle()
        else:
            await _watch(
                stack,
                store=store,
                plan=plan,
                traffic=traffic,
                feed=feed,
                stopping=stopping,
                view=view,
            )
    finally:
        view.close()
        await stack.stop()
    pod_names = [server.name for server in stack.sim.servers]
    return Run(policy, feed, traffic.results, time.monotonic() - started, pod_names)


async def _watch(
    stack: Stack,
    *,
    store: PolicyStore,
    plan: TrafficPlan,
    traffic: Traffic,
    feed: DecisionFeed,
    stopping: asyncio.Event,
    view: View,
) -> None:
    """Send the traffic while the view draws the pods and the decisions."""
    assert stack.policyd is not None and stack.envoy is not None
    settings = stack.settings
    pool = stack.policyd.pool
    view.start(
        [
            f"policy  {', '.join(p.name for p in store.current.policies)} "
            f"(version {store.current.version}) "
            f"from {store.path}; prefix matching {settings.prefix_index}, with the pods' tokenizer",
            f"envoy   {stack.url}  (admin 127.0.0.1:{stack.envoy.admin_port})  -> policyd "
            f"127.0.0.1:{stack.policyd.port} (ext_proc)",
            f"pods    {len(stack.sim.servers)} simulated vLLM pods at {settings.time_scale:g}x "
            f"real time; policyd scrapes their /metrics every "
            f"{settings.scrape_interval * 1000:.0f} ms",
            f"traffic {_describe(plan)}",
            "",
        ]
    )
    sending = asyncio.create_task(traffic.run(stopping))
    while True:
        finished = sending.done()
        if finished:
            stack.settle()  # the last requests' records, before the last update
        snapshot = pool.snapshot()
        view.update(
            feed,
            snapshot.pods,
            {pod.name for pod in snapshot.candidates},
            traffic.results,
            plan.requests,
        )
        if finished:
            break
        await asyncio.wait({sending}, timeout=0.25 if view.live else 0.5)
    await sending


def _describe(plan: TrafficPlan) -> str:
    """The traffic in a line, for the title."""
    prompts = (
        f"{plan.groups} groups of users, each with its own system prompt of "
        f"{plan.system_words[0]}-{plan.system_words[1]} words, and short questions"
    )
    adapters = f"{len(plan.adapters)} LoRA adapters of skewed popularity and the base model"
    shape = {
        "mixed": f"{prompts}, for {adapters}",
        "shared-prefix": f"{prompts}, base model only",
        "lora": f"short prompts for {adapters}",
    }[plan.workload]
    return f"{plan.workload}, {plan.rate:g} requests/s: {shape}"
