"""A pool of simulated pods in one process, on consecutive local ports.

With ``kv_events_port_base`` set, pod ``i`` publishes its KV events on
``kv_events_port_base + 2 * i`` and answers replay requests on the port after
(free ports for both if the base is 0).

``roles`` gives pod ``i`` its P/D role (prefill, decode or both; all both by
default), which ``pods_yaml`` writes as the ``llm-d.ai/role`` label policyd's
file discovery reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from types import TracebackType

import yaml

from policyd.sim.names import ROLE_LABEL, adapter_names, pod_name
from policyd.sim.profile import L4_LLAMA2_7B, Profile
from policyd.sim.server import SimServer


class SimPool:
    """``pods`` servers on ``base_port``, ``base_port + 1``, ... (all free ports if 0)."""

    def __init__(
        self,
        pods: int = 6,
        *,
        base_port: int = 8000,
        host: str = "127.0.0.1",
        profile: Profile = L4_LLAMA2_7B,
        adapters: int = 12,
        time_scale: float = 1.0,
        seed: int = 0,
        kv_events_port_base: int | None = None,
        roles: Sequence[str] | None = None,
        pd_in_process: bool = False,
    ) -> None:
        if pods < 1:
            raise ValueError("a pool needs at least one pod")
        if roles is not None and len(roles) != pods:
            raise ValueError(f"{len(roles)} roles for {pods} pods: give one role per pod")
        if base_port and not 0 < base_port + pods - 1 < 65536:
            raise ValueError(f"ports {base_port}..{base_port + pods - 1} are not all valid")
        kv_base = kv_events_port_base
        if kv_base and not 0 < kv_base + 2 * pods - 1 < 65536:
            last = kv_base + 2 * pods - 1
            raise ValueError(f"KV-event ports {kv_base}..{last} are not all valid")
        names = adapter_names(adapters)
        self.servers = [
            SimServer(
                profile,
                name=pod_name(i),
                host=host,
                port=base_port + i if base_port else 0,
                adapters=names,
                time_scale=time_scale,
                seed=seed * 1000 + i,
                kv_events_port=None if kv_base is None else kv_base and kv_base + 2 * i,
                kv_replay_port=None if kv_base is None else kv_base and kv_base + 2 * i + 1,
                role="both" if roles is None else roles[i],
                pd_in_process=pd_in_process,
            )
            for i in range(pods)
        ]

    def pods_yaml(self) -> str:
        """The pod file ``policyd serve --pods`` reads: names, addresses and role labels."""
        pods = [
            {"name": s.name, "address": s.address, "labels": {ROLE_LABEL: s.role}}
            for s in self.servers
        ]
        return yaml.safe_dump({"pods": pods}, sort_keys=False)

    async def start(self) -> None:
        """Start every server; if one cannot listen, stop the others and raise."""
        try:
            for server in self.servers:
                await server.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception):
                await server.stop()

    async def __aenter__(self) -> SimPool:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()
