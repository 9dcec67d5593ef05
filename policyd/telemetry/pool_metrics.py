"""The pool as policyd sees it, read when Prometheus scrapes: a custom collector.

Nothing is recorded per scrape round: at collection time the collector reads
the pool's current snapshot (pod metrics, in-flight counts, which pods are
candidates) and its per-pod scrape statistics, and reports them. Pods that
left the pool simply stop being reported, so the ``model_server_endpoint``
label stays bounded by the pool's size, and ``model_name`` (a pod's base
model) by the models it serves.

For autoscalers (KEDA, an HPA on external metrics), per base model: the
requests running and waiting on its pods, as scraped (the signals llm-d's
autoscaling reads from vLLM), and a saturation gauge: the mean over the
model's pods of how far each is towards the thresholds llm-d's saturation
detector uses by default (``SATURATION_QUEUE`` waiting requests, a
``SATURATION_KV_CACHE`` KV-cache use), the larger of the two, a pod without
fresh metrics counting as 1. Below 1 the pods have room; above 1 they are
past the thresholds, by as much as the value says.

The pool is anything of the ``PoolLike`` shape (``policyd.pool.Pool``):
``snapshot()`` -> a ``PoolSnapshot``, ``stats`` keyed by pod
address, and the ``rounds`` / ``overruns`` counters. Times in the statistics
are ``time.monotonic()`` seconds, the collector's default clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Final, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from policyd.pool.pod import Pod, PoolSnapshot
from policyd.telemetry.metrics import ENDPOINT, MODEL, DecisionMetrics

SATURATION_QUEUE: Final = 5  # llm-d's default queue-depth threshold
SATURATION_KV_CACHE: Final = 0.8  # llm-d's default KV-cache utilisation threshold


class ScrapeStatsLike(Protocol):
    @property
    def successes(self) -> int: ...
    @property
    def failures(self) -> int: ...
    @property
    def consecutive_failures(self) -> int: ...
    @property
    def last_latency(self) -> float | None: ...
    @property
    def last_success_at(self) -> float | None: ...


class PoolLike(Protocol):
    def snapshot(self) -> PoolSnapshot: ...
    @property
    def stats(self) -> Mapping[str, ScrapeStatsLike]: ...
    @property
    def rounds(self) -> int: ...
    @property
    def overruns(self) -> int: ...
    @property
    def panic_rounds(self) -> int: ...


class PoolCollector(Collector):
    """Reports the pool's pods and scrape health on every Prometheus scrape.

    With ``decisions`` given, each collection also drops the decision series
    of pods that left (``DecisionMetrics.retain_pods``) and pins the models the
    pods serve in its ``model_name`` label (``BoundedLabels.pin``).
    """

    def __init__(
        self,
        pool: PoolLike,
        *,
        decisions: DecisionMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._decisions = decisions
        self._clock = clock

    def describe(self) -> list[Metric]:
        return []  # names are checked at collection; registering must not read the pool

    def collect(self) -> Iterator[Metric]:
        snapshot = self._pool.snapshot()
        stats = self._pool.stats
        now = self._clock()
        if self._decisions is not None:
            self._decisions.retain_pods(pod.name for pod in snapshot.pods)
            self._decisions.models.pin(_served_models(snapshot.pods))
        candidates = {pod.address for pod in snapshot.candidates}
        pod_gauges = {
            name: GaugeMetricFamily(f"policyd_pod_{name}", text, labels=[ENDPOINT])
            for name, text in _POD_GAUGES
        }
        scrapes = CounterMetricFamily(
            "policyd_pod_scrapes",
            "Metrics scrapes of the pod by result (success, failure).",
            labels=[ENDPOINT, "result"],
        )
        for pod in snapshot.pods:
            labels = [pod.name]
            pod_gauges["candidate"].add_metric(labels, 1.0 if pod.address in candidates else 0.0)
            pod_gauges["waiting_requests"].add_metric(labels, pod.waiting_queue)
            pod_gauges["running_requests"].add_metric(labels, pod.running)
            pod_gauges["kv_cache_usage_ratio"].add_metric(labels, pod.kv_cache)
            pod_gauges["active_lora_adapters"].add_metric(labels, len(pod.active_loras))
            pod_gauges["max_lora_adapters"].add_metric(labels, pod.max_loras)
            pod_gauges["in_flight_requests"].add_metric(labels, pod.in_flight)
            pod_gauges["queued_prefill_tokens"].add_metric(labels, pod.queued_prefill_tokens)
            record = stats.get(pod.address)
            if record is None:
                continue
            scrapes.add_metric([pod.name, "success"], record.successes)
            scrapes.add_metric([pod.name, "failure"], record.failures)
            pod_gauges["scrape_consecutive_failures"].add_metric(
                labels, record.consecutive_failures
            )
            if record.last_latency is not None:
                pod_gauges["scrape_duration_seconds"].add_metric(labels, record.last_latency)
            age = math.inf if record.last_success_at is None else now - record.last_success_at
            pod_gauges["metrics_age_seconds"].add_metric(labels, max(age, 0.0))
        yield from pod_gauges.values()
        yield scrapes
        yield from _per_model(snapshot.pods, candidates)
        yield from _per_role(snapshot.pods, candidates)
        yield _gauge("policyd_pool_pods", "Pods discovered.", len(snapshot.pods))
        yield _gauge(
            "policyd_pool_candidate_pods",
            "Pods policies may choose from (answered the last scrape, metrics fresh).",
            len(snapshot.candidates),
        )
        yield _gauge(
            "policyd_pool_ready", "1 once every pod was scraped once.", float(snapshot.ready)
        )
        yield CounterMetricFamily(
            "policyd_pool_scrape_rounds", "Scrape rounds run.", value=self._pool.rounds
        )
        yield CounterMetricFamily(
            "policyd_pool_scrape_overruns",
            "Scrape rounds that ended after the next one was due.",
            value=self._pool.overruns,
        )
        yield CounterMetricFamily(
            "policyd_pool_panic_rounds",
            "Scrape rounds no pod answered, after which policies chose among the pods"
            " heard from within the stale threshold.",
            value=self._pool.panic_rounds,
        )


_POD_GAUGES = (
    ("candidate", "1 if policies may choose the pod now (fresh metrics), else 0."),
    ("waiting_requests", "Requests waiting in the pod's queue, as last scraped."),
    ("running_requests", "Requests running on the pod, as last scraped."),
    ("kv_cache_usage_ratio", "The pod's KV-cache use (0..1), as last scraped."),
    ("active_lora_adapters", "LoRA adapters with running requests, as last scraped."),
    ("max_lora_adapters", "LoRA adapters the pod can hold at once."),
    ("in_flight_requests", "Requests policyd routed to the pod that have not finished."),
    (
        "queued_prefill_tokens",
        "Uncached prompt tokens policyd routed to the pod that have no first token yet.",
    ),
    ("scrape_consecutive_failures", "Failed metrics scrapes of the pod since its last success."),
    ("scrape_duration_seconds", "How long the last metrics scrape of the pod took."),
    ("metrics_age_seconds", "Time since the pod's metrics were last scraped (+Inf: never)."),
)


def _served_models(pods: tuple[Pod, ...]) -> Iterator[str]:
    """Every model a pod reports serving: base models first, then adapters."""
    for pod in pods:
        yield pod.base_model
    for pod in pods:
        yield from pod.active_loras
        yield from pod.waiting_loras


def _per_model(pods: tuple[Pod, ...], candidates: set[str]) -> Iterator[Metric]:
    """Running, waiting and saturation summed per base model (see the module docstring)."""
    running: dict[str, float] = {}
    waiting: dict[str, float] = {}
    saturation: dict[str, float] = {}
    count: dict[str, int] = {}
    for pod in pods:
        model = pod.base_model
        running[model] = running.get(model, 0) + pod.running
        waiting[model] = waiting.get(model, 0) + pod.waiting_queue
        load = 1.0
        if pod.address in candidates:
            load = max(pod.waiting_queue / SATURATION_QUEUE, pod.kv_cache / SATURATION_KV_CACHE)
        saturation[model] = saturation.get(model, 0.0) + load
        count[model] = count.get(model, 0) + 1
    families = (
        ("policyd_model_running_requests", "Requests running on the model's pods, as scraped.",
         running),
        ("policyd_model_waiting_requests", "Requests waiting in the model's pods' queues, as "
         "scraped.", waiting),
        ("policyd_pool_saturation", "How far the model's pods are towards saturation (mean "
         "over its pods; 1: at the thresholds).",
         {model: total / count[model] for model, total in saturation.items()}),
    )  # fmt: skip
    for name, text, values in families:
        family = GaugeMetricFamily(name, text, labels=[MODEL])
        for model, value in values.items():
            family.add_metric([model], value)
        yield family


def _per_role(pods: tuple[Pod, ...], candidates: set[str]) -> Iterator[Metric]:
    """The load of each pod role (``pod.role``: prefill, decode, both), summed: how busy
    each group of a disaggregated pool is, to size one against the other. A split
    request counts in flight on its decode pod and its prefill pod alike."""
    totals: dict[str, list[float]] = {}
    for pod in pods:
        row = totals.setdefault(pod.role, [0.0, 0.0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += pod.address in candidates
        row[2] += pod.in_flight
        row[3] += pod.running
        row[4] += pod.waiting_queue
    families = (
        ("policyd_role_pods", "Pods discovered, by role."),
        ("policyd_role_candidate_pods", "Pods policies may choose from now, by role."),
        ("policyd_role_in_flight_requests", "Requests policyd routed to the role's pods that"
         " have not finished (a split request counts on both its pods)."),
        ("policyd_role_running_requests", "Requests running on the role's pods, as scraped."),
        ("policyd_role_waiting_requests", "Requests waiting in the role's pods' queues, as"
         " scraped."),
    )  # fmt: skip
    for index, (name, text) in enumerate(families):
        family = GaugeMetricFamily(name, text, labels=["role"])
        for role, row in totals.items():
            family.add_metric([role], row[index])
        yield family


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)
