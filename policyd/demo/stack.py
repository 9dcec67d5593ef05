"""The demo's three parts on loopback: simulated pods, policyd in process, the real Envoy.

Start order matters: pods first, then policyd (which loads the pod file and
scrapes every pod once, so its readiness check passes), then Envoy, whose
first health check of policyd then succeeds. Policyd matches prompts against
the pods' prefix caches with the pods' own tokenizer: in approximate mode
from its own routing, in precise mode from the KV events each pod publishes
on its own loopback ports, which the pod file's labels name. ``stop`` runs in the reverse
order and always completes, whatever failed; Envoy is also started with a
parent-death signal, so even a killed demo leaves no Envoy behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from policyd.extproc.assembly import Policyd
from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import EnvoyError, EnvoyProcess, start_envoy
from policyd.extproc.grpc_server import ServerOptions
from policyd.extproc.interfaces import Telemetry
from policyd.extproc.prefix_matching import KV_EVENTS_PORT_LABEL, KV_REPLAY_PORT_LABEL
from policyd.policy import PolicyStore
from policyd.pool import Pool, ScrapeConfig, StaticFileDiscovery
from policyd.prefix.options import Mode, PrefixSettings
from policyd.sim import L4_LLAMA2_7B, SimPool, SimServer

log = logging.getLogger("policyd.demo")


@dataclass(frozen=True, slots=True)
class StackSettings:
    pods: int = 6
    adapters: int = 12
    time_scale: float = 5.0
    seed: int = 0
    scrape_interval: float = 0.1
    prefix_index: Mode = "approximate"

    @property
    def prefix(self) -> PrefixSettings:
        """Policyd's prefix matching: the simulated pods' tokenizer and block size."""
        return PrefixSettings(
            mode=self.prefix_index, tokenizer="sim", block_size=L4_LLAMA2_7B.block_size
        )


class Stack:
    """Simulated pool + policyd + Envoy; ``url`` is Envoy's listener."""

    def __init__(self, settings: StackSettings, telemetry: Telemetry) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self.sim = SimPool(
            settings.pods,
            base_port=0,
            adapters=settings.adapters,
            time_scale=settings.time_scale,
            seed=settings.seed,
            kv_events_port_base=0 if settings.prefix_index == "precise" else None,
        )
        self.policyd: Policyd | None = None
        self.envoy: EnvoyProcess | None = None
        self._directory = tempfile.TemporaryDirectory(prefix="policyd-demo-")

    @property
    def directory(self) -> Path:
        return Path(self._directory.name)

    @property
    def url(self) -> str:
        if self.envoy is None:
            raise RuntimeError("the stack is not started")
        return f"http://127.0.0.1:{self.envoy.listen_port}"

    async def start(self, store: PolicyStore) -> None:
        """Start all three; on any failure stop what started and raise."""
        try:
            await self._start(store)
        except EnvoyError as error:
            log_tail = _tail(self.directory / "envoy.log")
            await self.stop()
            raise EnvoyError(f"{error}:\n{log_tail}") from None
        except BaseException:
            await self.stop()
            raise

    async def _start(self, store: PolicyStore) -> None:
        await self.sim.start()
        await warm_up(self.sim.servers)
        pods_file = self.directory / "pods.yaml"
        pods_file.write_text(
            "pods:\n"
            + "".join(
                f"  - {{name: {server.name}, address: '{server.address}'{_labels(server)}}}\n"
                for server in self.sim.servers
            )
        )
        pool = Pool(
            StaticFileDiscovery(pods_file),
            ScrapeConfig(interval=self.settings.scrape_interval),
        )
        self.policyd = Policyd(
            store,
            pool,
            ServerOptions(port=0, grace_seconds=1.0),
            telemetry=self.telemetry,
            prefix=self.settings.prefix,
        )
        await self.policyd.start()
        if not await pool.wait_ready(timeout=10):
            raise RuntimeError("the simulated pods did not answer their first scrape")
        await _scraped_lora_state(pool, len(self.sim.servers))
        await _subscribed(self.policyd)
        self.envoy = await start_envoy(
            self.directory,
            # The demo's traffic marks its critical requests itself: a trusted client.
            EnvoyConfigOptions(
                port=0, admin_port=0, policyd_port=self.policyd.port, stripped_headers=()
            ),
        )

    def settle(self) -> None:
        """Run policyd's queued bookkeeping now (it runs a few milliseconds after
        the replies), so the feed holds every request that has finished."""
        if self.policyd is not None:
            self.policyd.server.processor.settlement.flush()

    async def stop(self) -> None:
        envoy, self.envoy = self.envoy, None
        if envoy is not None:
            envoy.stop()
        service, self.policyd = self.policyd, None
        if service is not None:
            with contextlib.suppress(Exception):
                await service.stop(0)
        with contextlib.suppress(Exception):
            await self.sim.stop()
        self._directory.cleanup()


async def warm_up(servers: Sequence[SimServer]) -> None:
    """One tiny request straight to each pod, so each has published its LoRA state.

    vLLM prints ``vllm:lora_requests_info`` (and with it ``max_lora``) only
    once it has run a step; a pod that never served reads as having no
    adapter slots, and the seed policy's "low-cost lora" node passes it by. A
    pod in service has served, so the demo starts from there.
    """
    async with aiohttp.ClientSession() as session:
        for server in servers:
            body = {"model": server.profile.base_model, "prompt": "warm up", "max_tokens": 1}
            async with session.post(f"{server.url}/v1/completions", json=body) as response:
                response.raise_for_status()
                await response.read()


async def _scraped_lora_state(pool: Pool, pods: int, timeout: float = 5.0) -> None:
    """Wait until policyd's snapshot shows every pod's adapter slots."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        candidates = pool.snapshot().candidates
        if len(candidates) == pods and all(pod.max_loras > 0 for pod in candidates):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("policyd did not see every simulated pod's LoRA state in time")


async def _subscribed(service: Policyd, timeout: float = 5.0) -> None:
    """In precise mode, wait until policyd has connected to every pod's KV events,
    so that the first requests' blocks are not announced to nobody."""
    subscriber = service.prefix.subscriber
    if subscriber is None:
        return
    deadline = time.monotonic() + timeout
    pods = [pod.address for pod in service.pool.snapshot().pods]
    while time.monotonic() < deadline:
        stats = [subscriber.stats(pod) for pod in pods]
        if all(s is not None and s.connects > 0 for s in stats):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("policyd did not connect to every simulated pod's KV events in time")


def _labels(server: SimServer) -> str:
    """The pod file's labels: the pod's KV-event ports when it publishes events."""
    labels = [
        f"'{label}': '{port}'"
        for label, port in (
            (KV_EVENTS_PORT_LABEL, server.kv_events_port),
            (KV_REPLAY_PORT_LABEL, server.kv_replay_port),
        )
        if port is not None
    ]
    return f", labels: {{{', '.join(labels)}}}" if labels else ""


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no envoy log)"
