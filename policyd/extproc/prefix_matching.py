"""Prefix-cache matching for one serving process: the locator, kept in step with the pool.

The locator (``policyd.prefix``) names pods by address. This keeps it in
step with the pool: every second it drops pods that left from the index and,
in precise mode, follows exactly the current pods' KV-event publishers: the
pod's IP and ``--kv-events-port`` (and ``--kv-events-replay-port``), or the
ports its labels ``policyd/kv-events-port`` and
``policyd/kv-events-replay-port`` name, for pods that share one IP (the
simulator on loopback) or publish elsewhere. In approximate mode each pod's memory is
bounded by its own KV capacity as its metrics publish it
(``pod.kv_cache_blocks`` x ``pod.kv_block_size``, in the locator's blocks),
else by ``--prefix-cache-blocks`` or a default.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Final

from policyd.pool.pod import PoolSnapshot
from policyd.prefix.index import ApproximateIndex, PreciseIndex
from policyd.prefix.options import DEFAULT_CACHE_BLOCKS, PrefixSettings
from policyd.prefix.probe import PrefixLocator
from policyd.prefix.subscriber import KvEventSubscriber

log = logging.getLogger("policyd.extproc.prefix")

FOLLOW_SECONDS: Final = 1.0
KV_EVENTS_PORT_LABEL: Final = "policyd/kv-events-port"
KV_REPLAY_PORT_LABEL: Final = "policyd/kv-events-replay-port"


class PrefixMatching:
    """The process's ``PrefixLocator`` and the task that follows the pool for it.

    Raises ``ValueError`` when the tokenizer cannot be made (an unknown spec,
    an unreadable file).
    """

    def __init__(self, settings: PrefixSettings, snapshots: Callable[[], PoolSnapshot]) -> None:
        self.settings = settings
        self._snapshots = snapshots
        self._capacities: tuple[int, dict[str, int]] = (-1, {})
        self._replays: dict[str, str | None] = {}  # event endpoint -> replay endpoint
        # Pod address -> the model its metrics name: the seed of its base-model
        # blocks' keys when its KV-event topic names none (vLLM's default).
        self._models: dict[str, str] = {}
        self.subscriber: KvEventSubscriber | None = None
        index: ApproximateIndex | PreciseIndex
        if settings.mode == "precise":
            index = PreciseIndex()
            self.subscriber = KvEventSubscriber(
                index, replay_endpoint=self._replay_endpoint, model=self._model_of
            )
        elif settings.cache_blocks:
            index = ApproximateIndex(settings.cache_blocks)
        else:
            index = ApproximateIndex(self._capacity)
        self.locator = PrefixLocator(settings.make_tokenizer(), index, settings.block_size)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="prefix-follow")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.subscriber is not None:
            await self.subscriber.close()

    def follow_now(self) -> None:
        """Bring the index in step with the pool's current pods."""
        pods = self._snapshots().pods
        index = self.locator.index
        if self.subscriber is not None:
            endpoints: dict[str, str] = {}
            replays: dict[str, str | None] = {}
            for pod in pods:
                host = pod.address.rpartition(":")[0]
                events = _port(pod.labels, KV_EVENTS_PORT_LABEL, self.settings.kv_events_port)
                replay = _port(pod.labels, KV_REPLAY_PORT_LABEL, self.settings.kv_replay_port)
                endpoint = endpoints[pod.address] = f"tcp://{host}:{events}"
                replays[endpoint] = None if replay is None else f"tcp://{host}:{replay}"
            self._replays = replays
            self._models = {pod.address: pod.base_model for pod in pods if pod.base_model}
            self.subscriber.follow(endpoints)
        elif isinstance(index, ApproximateIndex):
            index.retain({pod.address for pod in pods})

    async def _follow(self) -> None:
        while True:
            try:
                self.follow_now()
            except Exception:  # a bug here must not stop the following, nor serving
                log.exception("prefix matching could not follow the pool")
            await asyncio.sleep(FOLLOW_SECONDS)

    def _capacity(self, address: str) -> int:
        """Blocks to remember for the pod at ``address``: its own KV capacity if known."""
        snapshot = self._snapshots()
        version, capacities = self._capacities
        if version != snapshot.version:
            block_size = self.settings.block_size
            capacities = {
                pod.address: pod.kv_cache_blocks * pod.kv_block_size // block_size
                for pod in snapshot.pods
                if pod.kv_cache_blocks > 0 and pod.kv_block_size > 0
            }
            self._capacities = (snapshot.version, capacities)
        return capacities.get(address, DEFAULT_CACHE_BLOCKS)

    def _replay_endpoint(self, endpoint: str) -> str | None:
        return self._replays.get(endpoint)

    def _model_of(self, address: str) -> str | None:
        return self._models.get(address)


def _port(labels: Mapping[str, str], label: str, default: int | None) -> int | None:
    """The port a pod's label names, else ``default``; a bad value is logged and ignored."""
    text = labels.get(label)
    if text is None:
        return default
    if text.isdigit() and 0 < int(text) < 65536:
        return int(text)
    _warn_once(label, text, default)
    return default


@functools.lru_cache(maxsize=256)  # once per bad value, not every second
def _warn_once(label: str, text: str, default: int | None) -> None:
    log.warning("pod label %s=%r is no port; using %s", label, text, default)
