"""A cold pool: simulated vLLM pods that have not served yet, behind Envoy and policyd.

Issue 23, item 3: a vLLM pod prints ``vllm:lora_requests_info`` only once it
has logged its stats, so in a freshly started pool the pods that have not
served anything show no LoRA state. policyd marks such a pod
``lora_info_known`` false (its ``max_loras`` 0 is for want of knowledge), and
the seed policy's free-slot rules keep it: read as full, those pods would be
dropped, and a sequential run of 20 LoRA requests would all go to the one pod
that had served the first. Here the simulated pods log their stats only after serving (a
stats interval longer than the test, as vLLM V1 engines of some versions do),
so every pod but those that served stays unknown for the whole run.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from e2e_rig import until

from policyd.extproc.assembly import Policyd
from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import start_envoy
from policyd.extproc.grpc_server import ServerOptions
from policyd.policy import PolicyStore
from policyd.pool import Pool, ScrapeConfig, StaticFileDiscovery
from policyd.sim import L4_LLAMA2_7B, SimPool, adapter_names

pytestmark = [pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
SCRAPE_INTERVAL = 0.05


def served(sim: SimPool) -> Counter[str]:
    """Requests each simulated pod has finished (counted by the pod itself)."""
    counts = {s.name: sum(s.driver.engine.stats.finished.values()) for s in sim.servers}
    return Counter({name: count for name, count in counts.items() if count})


def pods_file(directory: Path, sim: SimPool) -> Path:
    path = directory / "pods.yaml"
    path.write_text(
        "pods:\n"
        + "".join(f"  - {{name: {s.name}, address: '{s.address}'}}\n" for s in sim.servers)
    )
    return path


@contextlib.asynccontextmanager
async def cold_pool(
    tmp_path: Path, *, log_stats_interval_s: float, envoy: bool = True
) -> AsyncIterator[tuple[str, SimPool, Policyd]]:
    """Fresh simulated pods (none has served), policyd over ``rules/default.yaml``
    and, with ``envoy``, the real Envoy in front: (Envoy's URL or "", pods, policyd)."""
    profile = L4_LLAMA2_7B.with_changes(log_stats_interval_s=log_stats_interval_s)
    sim = SimPool(6, base_port=0, time_scale=4.0, profile=profile)
    await sim.start()
    service = Policyd(
        PolicyStore.open(REPO / "rules" / "default.yaml"),
        Pool(
            StaticFileDiscovery(pods_file(tmp_path, sim)),
            # Pods heard from stay candidates through rounds a loaded machine misses.
            ScrapeConfig(interval=SCRAPE_INTERVAL, timeout=SCRAPE_INTERVAL, stale_after=30.0),
        ),
        ServerOptions(port=0, grace_seconds=5.0),
    )
    process = None
    try:
        await service.start()
        assert await service.pool.wait_ready(timeout=10)
        if envoy:
            process = await start_envoy(
                tmp_path, EnvoyConfigOptions(port=0, admin_port=0, policyd_port=service.port)
            )
        yield ("" if process is None else f"http://127.0.0.1:{process.listen_port}"), sim, service
    finally:
        if process is not None:
            process.stop()
        await service.stop(0)
        await sim.stop()


async def test_a_sequential_run_over_a_cold_pool_spreads_over_its_pods(tmp_path: Path) -> None:
    async with cold_pool(tmp_path, log_stats_interval_s=1e6) as (url, sim, service):
        pods = service.pool.snapshot().candidates
        assert len(pods) == 6
        assert all(not pod.lora_info_known and pod.max_loras == 0 for pod in pods)
        adapters = adapter_names(12)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
            for i in range(20):
                before = served(sim)
                body = {"model": adapters[i % 12], "prompt": f"cold {i}", "max_tokens": 4}
                async with client.post(f"{url}/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
                [pod] = (served(sim) - before).keys()

                # Before the next request, policyd has scraped the pod that served:
                # it now shows its free adapter slots, the others still nothing.
                def scraped(name: str = pod) -> bool:
                    state = {p.name: p for p in service.pool.snapshot().candidates}[name]
                    return state.max_loras == 4 and state.running == 0

                await until(scraped, f"policyd to scrape {pod} after it served")
        spread = served(sim)
        assert sum(spread.values()) == 20
        # Every request on the pod that served first would be the failure; random routing
        # over 6 pods puts 20 requests on at least 3 of them but for ~1e-10 odds.
        assert len(spread) > 1, spread
        known = {p.name for p in service.pool.snapshot().candidates if p.lora_info_known}
        assert known == set(spread), "only pods that served have published their LoRA state"


async def test_an_idle_pool_publishes_its_lora_state_without_serving(tmp_path: Path) -> None:
    # The simulator logs an idle pod's stats every 10 simulated seconds (2.5 s
    # at time scale 4), as vLLM does: policyd then knows every pod's slots.
    async with cold_pool(tmp_path, log_stats_interval_s=10.0, envoy=False) as (_, sim, service):

        def known() -> bool:
            pods = service.pool.snapshot().candidates
            return len(pods) == 6 and all(p.lora_info_known and p.max_loras == 4 for p in pods)

        await until(known, "every pod's LoRA state", timeout=10.0)
        assert sum(served(sim).values()) == 0
