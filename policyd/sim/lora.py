"""Where a pod's LoRA adapters live, and what bringing one into a batch costs.

vLLM keeps up to ``max_loras`` adapters in GPU slots and up to
``max_cpu_loras`` loaded in host memory, each an LRU cache touched by every
batch that uses the adapter. A batch that needs an adapter outside the GPU
slots pays a copy into a slot (small); if the adapter is not in host memory
either, it pays a load from disk instead (large, the copy included). The
scheduler guarantees at most ``max_loras`` adapters run at once, so an adapter
still in use is never the one evicted from a slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from policyd.sim.profile import Profile


class _LruSet:
    """Names in least-recently-used order with a capacity; touching may evict."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._names: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def touch(self, name: str) -> None:
        self._names[name] = None
        self._names.move_to_end(name)
        if len(self._names) > self._capacity:
            self._names.popitem(last=False)


class AdapterResidence:
    """GPU slots and host-memory cache of one pod, with the cost of activation."""

    def __init__(self, profile: Profile) -> None:
        self._profile = profile
        self._gpu = _LruSet(profile.max_loras)
        self._cpu = _LruSet(profile.max_cpu_loras)

    def activate(self, in_batch: Iterable[str], needed: Iterable[str]) -> float:
        """Make the adapters of a step resident; returns the seconds the step pays.

        ``in_batch`` are the adapters already running (touched so they stay the
        most recently used); ``needed`` are the adapters the step brings in.
        """
        for name in in_batch:
            self._gpu.touch(name)
            self._cpu.touch(name)
        cost = 0.0
        for name in needed:
            if name not in self._gpu:
                cost += (
                    self._profile.lora_gpu_load_s
                    if name in self._cpu
                    else self._profile.lora_disk_load_s
                )
            self._gpu.touch(name)
            self._cpu.touch(name)
        return cost
