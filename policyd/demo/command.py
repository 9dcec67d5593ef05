"""``policyd demo``: the command line (see the package docstring for what runs)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

from policyd.demo.feed import DecisionFeed
from policyd.demo.stack import Stack, StackSettings
from policyd.demo.traffic import Traffic, TrafficPlan
from policyd.demo.view import View, summary
from policyd.extproc.envoy_process import EnvoyError
from policyd.policy import PolicyError, PolicyStore
from policyd.sim import L4_LLAMA2_7B, adapter_names

EXIT_INTERRUPTED = 130


def default_policy() -> Path:
    """``rules/default.yaml`` of the checkout policyd runs from, else of the working directory."""
    beside_package = Path(__file__).resolve().parents[2] / "rules" / "default.yaml"
    return beside_package if beside_package.is_file() else Path("rules/default.yaml")


def register(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        type=Path,
        default=None,
        metavar="PATH",
        help="policy file or directory (default: the checkout's rules/default.yaml)",
    )
    parser.add_argument(
        "--requests", type=int, default=200, metavar="N", help="requests to send (default 200)"
    )
    parser.add_argument(
        "--continuous", action="store_true", help="keep sending until Ctrl-C (ignores --requests)"
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
    policy = arguments.policy or default_policy()
    try:
        store = PolicyStore.open(policy)
    except PolicyError as error:
        print(f"policyd demo: the policy does not load:\n{error}", file=sys.stderr)
        return 1
    return asyncio.run(_demo(arguments, store))


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


async def _demo(arguments: argparse.Namespace, store: PolicyStore) -> int:
    out = sys.stdout
    view = View(out, live=out.isatty() and not arguments.plain)
    root = logging.getLogger()
    root.addHandler(view.log if view.live else logging.StreamHandler(sys.stderr))
    root.setLevel(logging.WARNING)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)

    feed = DecisionFeed()
    settings = StackSettings(
        pods=arguments.pods,
        adapters=arguments.adapters,
        time_scale=arguments.time_scale,
        seed=arguments.seed,
    )
    stack = Stack(settings, feed)
    print(
        f"policyd demo: starting {arguments.pods} simulated vLLM pods "
        f"({L4_LLAMA2_7B.base_model}, {arguments.adapters} LoRA adapters), policyd and Envoy ...",
        flush=True,
    )
    try:
        await stack.start(store)
    except (EnvoyError, OSError, RuntimeError) as error:
        print(f"policyd demo: could not start: {error}", file=sys.stderr)
        return 1
    adapters = adapter_names(arguments.adapters)
    plan = TrafficPlan(
        models=(*adapters, L4_LLAMA2_7B.base_model),
        requests=None if arguments.continuous else arguments.requests,
        rate=arguments.rate,
        max_in_flight=arguments.max_in_flight,
        seed=arguments.seed,
    )
    traffic = Traffic(stack.url, plan)
    assert stack.policyd is not None and stack.envoy is not None
    pool = stack.policyd.pool
    view.start(
        [
            f"policy  {', '.join(p.name for p in store.current.policies)} "
            f"(version {store.current.version}) "
            f"from {store.path}",
            f"envoy   {stack.url}  (admin 127.0.0.1:{stack.envoy.admin_port})  -> policyd "
            f"127.0.0.1:{stack.policyd.port} (ext_proc)",
            f"pods    {len(stack.sim.servers)} simulated vLLM pods at {arguments.time_scale:g}x "
            f"real time; policyd scrapes their /metrics every "
            f"{settings.scrape_interval * 1000:.0f} ms",
            "",
        ]
    )
    started = time.monotonic()
    sending = asyncio.create_task(traffic.run(stopping))
    try:
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
    finally:
        view.close()
        await stack.stop()
    elapsed = time.monotonic() - started
    pod_names = [server.name for server in stack.sim.servers]
    for line in summary(
        feed,
        traffic.results,
        seconds=elapsed,
        pod_names=pod_names,
        time_scale=arguments.time_scale,
        adapters=adapters,
    ):
        print(line)
    if stopping.is_set():
        print("policyd demo: interrupted; everything is stopped")
        return EXIT_INTERRUPTED
    ok = traffic.results.statuses.get(200, 0)
    return 0 if ok else 1
