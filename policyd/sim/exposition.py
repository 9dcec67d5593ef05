"""``/metrics`` of a simulated pod: vLLM's Prometheus metric names, labels and types.

A collector reads the engine at scrape time and the standard ``prometheus_client``
text encoder writes it, so the bytes are what vLLM (which uses the same library)
serves. Scheduler gauges come from the engine's snapshot, refreshed after every
step as vLLM logs them. Both KV-cache gauge names are exported, the current
``vllm:kv_cache_usage_perc`` and the older ``vllm:gpu_cache_usage_perc``, because
scrapers in the field read one or the other. ``vllm:lora_requests_info`` is a
family of series, one per combination of running and waiting adapters ever
seen; each holds the Unix time its combination was last current, so the
newest is the current one (the oldest beyond a bound are dropped, see
``stats.LORA_SERIES_KEPT``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from policyd.sim.engine import Engine
from policyd.sim.stats import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MODEL = ["model_name"]


def _le(bound: float) -> str:
    """A bucket bound as Prometheus writes it (``0.5``, ``10.0``, ``+Inf``)."""
    return "+Inf" if math.isinf(bound) else repr(bound)


def _gauge(name: str, documentation: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=_MODEL)
    family.add_metric([model], value)
    return family


def _counter(name: str, documentation: str, model: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=_MODEL)
    family.add_metric([model], value)
    return family


def _histogram(
    name: str, documentation: str, model: str, histogram: Histogram
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=_MODEL)
    buckets = [(_le(bound), float(n)) for bound, n in histogram.cumulative()]
    family.add_metric([model], buckets, histogram.total)
    return family


class EngineCollector:
    """Turns the engine of a pod into metric families at every scrape."""

    def __init__(
        self,
        engine: Callable[[], Engine],
        model_name: str,
        unix_time: Callable[[float], float],
    ) -> None:
        self._engine = engine
        self._model = model_name
        self._unix_time = unix_time

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        model = self._model
        snapshot = engine.snapshot()
        stats = engine.stats
        profile = engine.profile
        yield _gauge(
            "vllm:num_requests_running",
            "Number of requests currently running on GPU.",
            model,
            snapshot.running,
        )
        yield _gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            model,
            snapshot.waiting,
        )
        yield _gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            model,
            snapshot.kv_cache_usage,
        )
        yield _gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.",
            model,
            snapshot.kv_cache_usage,
        )
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
        )
        for (running, waiting), at in stats.lora_series.items():
            lora.add_metric([running, str(profile.max_loras), waiting], self._unix_time(at))
        yield lora
        cache = {
            "block_size": str(profile.block_size),
            "cache_dtype": "auto",
            "cpu_offload_gb": "0",
            "enable_prefix_caching": str(profile.enable_prefix_caching),
            "gpu_memory_utilization": str(profile.gpu_memory_utilization),
            "num_cpu_blocks": str(profile.num_cpu_blocks),
            "num_gpu_blocks": str(profile.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "sliding_window": "None",
            "swap_space_bytes": str(profile.swap_space_bytes),
        }
        config = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(cache),
        )
        config.add_metric(list(cache.values()), 1.0)
        yield config
        yield _counter(
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
            model,
            stats.preemptions,
        )
        yield _counter(
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            model,
            stats.prompt_tokens,
        )
        yield _counter(
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            model,
            stats.generation_tokens,
        )
        yield _counter(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            model,
            stats.prefix_cache_queries,
        )
        yield _counter(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            model,
            stats.prefix_cache_hits,
        )
        success = CounterMetricFamily(
            "vllm:request_success_total",
            "Count of successfully processed requests.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(stats.finished.items()):
            success.add_metric([model, reason], count)
        yield success
        yield _histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            model,
            stats.time_to_first_token,
        )
        yield _histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            model,
            stats.time_per_output_token,
        )
        yield _histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            model,
            stats.e2e_request_latency,
        )
        if stats.nixl_bytes_transferred.count:  # vLLM shows them once its connector has read
            yield _histogram(
                "vllm:nixl_xfer_time_seconds",
                "Histogram of transfer duration for NIXL KV Cache transfers.",
                model,
                stats.nixl_xfer_time,
            )
            yield _histogram(
                "vllm:nixl_post_time_seconds",
                "Histogram of transfer post time for NIXL KV Cache transfers.",
                model,
                stats.nixl_post_time,
            )
            yield _histogram(
                "vllm:nixl_bytes_transferred",
                "Histogram of bytes transferred per NIXL KV Cache transfers.",
                model,
                stats.nixl_bytes_transferred,
            )


def metrics_registry(collector: EngineCollector) -> CollectorRegistry:
    """A registry of its own per pod, so pods in one process do not mix their series."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of one pod."""
    return generate_latest(registry)
