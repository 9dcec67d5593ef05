"""``policyd sim``: a pool of simulated vLLM pods on local ports until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

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
    pd = parser.add_argument_group("disaggregated prefill/decode (V1 profiles)")
    pd.add_argument(
        "--roles",
        metavar="LIST",
        help="comma-separated role of each pod: prefill, decode or both (default: all both)",
    )
    pd.add_argument(
        "--pd-in-process",
        action="store_true",
        help="a pod given x-prefiller-host-port asks that pod to prefill, as llm-d's P/D "
        "sidecar would (default: the header is ignored, as vLLM ignores it)",
    )
    pd.add_argument(
        "--kv-transfer-gb-per-s",
        type=float,
        metavar="GB/s",
        help="KV transfer bandwidth in 10^9 bytes per second (default: the profile's)",
    )
    pd.add_argument(
        "--kv-transfer-setup-ms",
        type=float,
        metavar="MS",
        help="fixed time of one KV transfer before its bytes flow (default: the profile's)",
    )
    parser.add_argument(
        "--pods-file",
        type=Path,
        metavar="FILE",
        help="write the pods (name, address, llm-d.ai/role label) for policyd serve --pods",
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
        profile = get_profile(arguments.profile)
        if arguments.kv_transfer_gb_per_s is not None:
            profile = profile.with_changes(
                kv_transfer_bytes_per_s=arguments.kv_transfer_gb_per_s * 1e9
            )
        if arguments.kv_transfer_setup_ms is not None:
            profile = profile.with_changes(kv_transfer_setup_s=arguments.kv_transfer_setup_ms / 1e3)
        roles = None if arguments.roles is None else arguments.roles.split(",")
        pool = SimPool(
            arguments.pods,
            base_port=arguments.base_port,
            host=arguments.host,
            profile=profile,
            roles=roles,
            pd_in_process=arguments.pd_in_process,
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
    # Before anything is printed or written: whoever waits for that may stop us at once.
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signal_number, stopping.set)
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
        role = "" if server.role == "both" else f" role {server.role}"
        print(f"{server.name} {server.url}{role}{kv}", flush=True)
    if arguments.pods_file is not None:  # whole or not at all, for a reader polling it
        partial = arguments.pods_file.with_name(arguments.pods_file.name + ".partial")
        partial.write_text(pool.pods_yaml())
        partial.replace(arguments.pods_file)
    try:
        await stopping.wait()
    finally:
        await pool.stop()
    return 0
