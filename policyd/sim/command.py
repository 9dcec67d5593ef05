"""``policyd sim``: a pool of simulated vLLM pods on local ports until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from policyd.sim.pool import SimPool
from policyd.sim.profile import PROFILES, get_profile


def register(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", type=int, default=6, help="number of pods (default 6)")
    parser.add_argument(
        "--base-port",
        type=int,
        default=8000,
        help="port of the first pod, the others follow; 0 picks free ports (default 8000)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--profile",
        default="l4-llama2-7b",
        choices=sorted(PROFILES),
        help="calibration profile: l4-llama2-7b (vLLM V0, the seed experiment's; default), "
        "h100-llama3.1-8b or l4-llama3.1-8b (vLLM V1)",
    )
    parser.add_argument(
        "--adapters", type=int, default=12, help="LoRA adapters per pod, adapter-0.. (default 12)"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="run simulated time this many times faster than the clock (default 1)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the output lengths")
    parser.add_argument(
        "--kv-events-port-base",
        type=int,
        default=None,
        metavar="PORT",
        help="publish vLLM KV-cache events over ZMQ: pod i on PORT+2i, its replay socket on "
        "PORT+2i+1; 0 picks free ports (default: no events)",
    )
    parser.set_defaults(run=run)


def run(arguments: argparse.Namespace) -> int:
    if arguments.kv_events_port_base is not None and arguments.kv_events_port_base < 0:
        print("policyd sim: --kv-events-port-base must be >= 0", file=sys.stderr)
        return 2
    if arguments.pods < 1 or arguments.adapters < 0 or arguments.time_scale <= 0:
        print(
            "policyd sim: --pods must be >= 1, --adapters >= 0, --time-scale > 0", file=sys.stderr
        )
        return 2
    try:
        pool = SimPool(
            arguments.pods,
            base_port=arguments.base_port,
            host=arguments.host,
            profile=get_profile(arguments.profile),
            adapters=arguments.adapters,
            time_scale=arguments.time_scale,
            seed=arguments.seed,
            kv_events_port_base=arguments.kv_events_port_base,
        )
    except ValueError as error:
        print(f"policyd sim: {error}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(pool, arguments))


async def _serve(pool: SimPool, arguments: argparse.Namespace) -> int:
    try:
        await pool.start()
    except OSError as error:
        print(f"policyd sim: cannot listen: {error}", file=sys.stderr)
        return 1
    first = pool.servers[0]
    names = first.adapters
    adapters = f"{len(names)} adapters ({names[0]}..{names[-1]})" if names else "no adapters"
    print(
        f"policyd sim: {len(pool.servers)} pods of {arguments.profile}: "
        f"{first.profile.base_model} with {adapters}, time scale {arguments.time_scale:g}; "
        "Ctrl-C stops",
        flush=True,
    )
    for server in pool.servers:
        events = server.kv_events_endpoint
        replay = f" replay {server.kv_replay_endpoint}" if server.kv_replay_endpoint else ""
        kv = f" kv-events {events}{replay}" if events else ""
        print(f"{server.name} {server.url}{kv}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signal_number, stopping.set)
    try:
        await stopping.wait()
    finally:
        await pool.stop()
    return 0
