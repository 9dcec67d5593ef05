"""How Envoy's requests spread over ``policyd serve --workers N``, by streams per connection.

    python benchmarks/worker_spread.py [--workers 2] [--caps 0,32,8]
                                       [--concurrency 16,64,256] [--requests 320]

``--workers N`` binds N processes to one port with ``SO_REUSEPORT``, and the
kernel spreads connections, not streams. Envoy puts an ext_proc stream per
request on its connections to policyd, filling one to
``max_concurrent_streams`` before it uses another. This runs the real Envoy
(one thread) with ``policyd envoy-config``'s bootstrap at each cap (0: no
cap, Envoy's default), ``policyd serve --workers N`` over two simulated pods,
and a client at each concurrency, and prints how many decisions each worker
made (read from each worker's ``/metrics``). Not a speed figure: a share.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
from overhead import concurrency_levels, policyd_ready
from prometheus_client.parser import text_string_to_metric_families

from policyd.demo.stack import warm_up
from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import free_port, free_port_range, start_envoy
from policyd.sim import SimPool

REPO = Path(__file__).resolve().parents[1]


def decisions(text: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "policyd_decisions"
        for sample in family.samples
        if sample.name == "policyd_decisions_total"
    )


async def spread(pods_file: Path, cap: int, concurrency: int, arguments: argparse.Namespace) -> str:
    """Decisions per worker for one cap and one concurrency, as ``a / b / ...``."""
    port, monitoring = free_port(), free_port_range(arguments.workers)
    command = [
        sys.executable, "-m", "policyd", "serve",
        "--policy", str(REPO / "rules" / "default.yaml"), "--pods", str(pods_file),
        "--port", str(port), "--workers", str(arguments.workers),
        "--monitoring-port", str(monitoring), "--log-level", "error",
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    envoy = None
    try:
        await policyd_ready(port, pods=2)
        streams = cap or 2**31 - 1  # Envoy's own default: no cap
        options = EnvoyConfigOptions(
            port=0, admin_port=0, policyd_port=port, policyd_streams_per_connection=streams
        )
        envoy = await start_envoy(pods_file.parent, options)
        url = f"http://127.0.0.1:{envoy.listen_port}/v1/completions"
        body = {"model": "adapter-1", "prompt": "hello", "max_tokens": 1}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as client:
            sent = 0

            async def one() -> None:
                nonlocal sent
                while sent < arguments.requests:
                    sent += 1
                    async with client.post(url, json=body) as response:
                        await response.read()

            await asyncio.gather(*(one() for _ in range(concurrency)))
            await asyncio.sleep(0.2)  # decisions are counted a few milliseconds after replies
            counts = []
            for index in range(arguments.workers):
                metrics = f"http://127.0.0.1:{monitoring + index}/metrics"
                async with client.get(metrics) as response:
                    counts.append(decisions(await response.text()))
        return " / ".join(f"{count:.0f}" for count in counts)
    finally:
        if envoy is not None:
            envoy.stop()
        process.terminate()
        process.wait(30)


async def main(arguments: argparse.Namespace) -> None:
    caps = [int(c) for c in arguments.caps.split(",")]
    async with SimPool(2, base_port=0, time_scale=10) as sim:
        await warm_up(sim.servers)
        with tempfile.TemporaryDirectory() as directory:
            pods_file = Path(directory) / "pods.yaml"
            pods_file.write_text(
                "pods:\n"
                + "".join(f"  - {{name: {s.name}, address: '{s.address}'}}\n" for s in sim.servers)
            )
            print(f"decisions per worker, {arguments.requests} requests per cell")
            print(
                f"{'concurrency':>12}" + "".join(f"{'cap ' + str(c or 'none'):>20}" for c in caps)
            )
            for level in arguments.concurrency:
                cells = [await spread(pods_file, cap, level, arguments) for cap in caps]
                print(f"{level:>12}" + "".join(f"{cell:>20}" for cell in cells))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--caps", default="0,32,8", help="streams per connection; 0: no cap")
    parser.add_argument("--concurrency", type=concurrency_levels, default="16,64,256")
    parser.add_argument("--requests", type=int, default=320, help="requests per cell")
    asyncio.run(main(parser.parse_args()))
