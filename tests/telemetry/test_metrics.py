"""Prometheus metrics: decisions, nodes, shadows, responses, reloads, the pool, /metrics."""

from __future__ import annotations

import gc
import math
import tracemalloc
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from telemetry_support import pods, request, router_for, write_policies

from policyd.policy import PolicyStore
from policyd.policy.decision import Decision, NodeTrace, Outcome
from policyd.pool.pod import Pod
from policyd.telemetry import (
    DecisionMetrics,
    DecisionTelemetry,
    PoolCollector,
    start_metrics_server,
)
from policyd.telemetry.exchange_end import ExchangeEnd

LIVE = {"policy": "live", "model_name": "llama"}  # what telemetry_support's requests get
ROUTED_A = {"model_server_endpoint": "a", "model_name": "llama"}
NOT_ROUTED = {"model_server_endpoint": "", "model_name": "llama"}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def served(metrics: DecisionMetrics, tmp_path: Path, count: int = 1, busy: bool = False) -> None:
    """``count`` requests through the real router and DecisionTelemetry, responses 200."""
    router = router_for(tmp_path)
    telemetry = DecisionTelemetry(metrics=metrics)
    candidates = [Pod("c", "10.0.0.3:8000", waiting_queue=30)] if busy else pods()
    for _ in range(count):
        decision = router.decide(request(), candidates)
        record = telemetry.start(request(), decision, {}, 0.0004)
        record.after_reply(router.decide_shadows(decision))
        record.response_headers(200 if not busy else 429, 0.01)
        record.end(
            ExchangeEnd(
                completed=True,
                duration_seconds=0.8,
                first_body_seconds=0.2 if not busy else None,
                prompt_tokens=None,
                completion_tokens=None,
            )
        )


def test_decisions_nodes_and_latency_are_counted(tmp_path: Path) -> None:
    metrics = DecisionMetrics()
    served(metrics, tmp_path, count=3)
    r = metrics.registry
    assert value(r, "policyd_decisions_total", policy="live", outcome="routed", **ROUTED_A) == 3
    assert value(r, "policyd_decision_duration_seconds_count", policy="live") == 3
    assert value(r, "policyd_decision_duration_seconds_bucket", policy="live", le="0.0005") == 3
    assert value(r, "policyd_decision_duration_seconds_bucket", policy="live", le="0.00025") == 0
    visits = {"policy": "live", "node": "short queue", "kind": "keep", "branch": "on_success"}
    assert value(r, "policyd_filter_node_visits_total", **visits) == 3
    node = {"policy": "live", "node": "short queue"}
    assert value(r, "policyd_filter_node_pods_total", **node, result="kept") == 6
    assert value(r, "policyd_filter_node_pods_total", **node, result="dropped") == 3
    assert value(r, "policyd_filter_node_errors_total", **node) is None  # no errors
    assert value(r, "policyd_responses_total", **LIVE, status_class="2xx") == 3
    assert value(r, "policyd_response_time_to_first_token_seconds_count", **LIVE) == 3
    assert value(r, "policyd_response_duration_seconds_sum", **LIVE) == pytest.approx(2.4)


def test_decisions_that_share_a_walk_are_each_counted(tmp_path: Path) -> None:
    """A reused walk hands every decision the same step objects, whose tally
    increments are worked out once: each decision must still count in full."""
    router = router_for(tmp_path)
    metrics = DecisionMetrics()
    telemetry = DecisionTelemetry(metrics=metrics)
    candidates = tuple(pods())  # a tuple: the router may reuse the walk
    decisions = [router.decide(request(), candidates) for _ in range(4)]
    assert decisions[0].trace[0] is decisions[3].trace[0]  # the walk was reused
    fresh = router.decide(request(), list(candidates))  # a list: walked anew
    assert fresh.trace[0] is not decisions[0].trace[0]
    for decision in [*decisions, fresh]:
        telemetry.start(request(), decision, {}, 0.0001).after_reply()
    r = metrics.registry
    visits = {"policy": "live", "node": "short queue", "kind": "keep", "branch": "on_success"}
    assert value(r, "policyd_filter_node_visits_total", **visits) == 5
    node = {"policy": "live", "node": "short queue"}
    assert value(r, "policyd_filter_node_pods_total", **node, result="kept") == 10
    assert value(r, "policyd_filter_node_pods_total", **node, result="dropped") == 5


def test_a_shared_walk_with_a_scoring_step_per_request_counts_each_requests_errors() -> None:
    """The router adds the scoring step to a reused walk per request: every request
    counts the walk's steps and its own scoring errors."""
    metrics = DecisionMetrics()
    walk = (NodeTrace("short queue", "keep", 3, ("a", "b"), branch="on_success", narrows=True),)
    for errors in (1, 2, 0):
        scoring = NodeTrace("score", "score", 2, (), tuple(("a", "x") for _ in range(errors)))
        decision = Decision(
            Outcome.ROUTED, "live", "1", "m", "10.0.0.1:8000", "a", trace=(*walk, scoring)
        )
        metrics.decision(decision, 0.0001)
    r = metrics.registry
    node = {"policy": "live", "node": "short queue"}
    assert (
        value(r, "policyd_filter_node_visits_total", **node, kind="keep", branch="on_success") == 3
    )
    assert value(r, "policyd_filter_node_pods_total", **node, result="dropped") == 3
    assert value(r, "policyd_filter_node_errors_total", policy="live", node="score") == 3
    assert (
        value(
            r,
            "policyd_filter_node_visits_total",
            policy="live",
            node="score",
            kind="score",
            branch="end",
        )
        is None
    )


def test_shed_decisions_and_their_walk(tmp_path: Path) -> None:
    metrics = DecisionMetrics()
    served(metrics, tmp_path, count=2, busy=True)
    r = metrics.registry
    assert value(r, "policyd_decisions_total", policy="live", outcome="shed", **NOT_ROUTED) == 2
    failure = {"policy": "live", "node": "short queue", "kind": "keep", "branch": "on_failure"}
    assert value(r, "policyd_filter_node_visits_total", **failure) == 2
    shed = {"policy": "live", "node": "too busy", "kind": "shed", "branch": "end"}
    assert value(r, "policyd_filter_node_visits_total", **shed) == 2
    assert value(r, "policyd_responses_total", **LIVE, status_class="4xx") is None


def test_cel_errors_are_counted_per_node(tmp_path: Path) -> None:
    live = (
        "name: live\nfilters:\n  zone:\n    keep: pod.labels['zone'] == 'a'\n    on_error: pass\n"
    )
    (tmp_path / "live.yaml").write_text(live)
    from policyd.policy import Router

    router = Router(PolicyStore.open(tmp_path / "live.yaml"))
    metrics = DecisionMetrics()
    telemetry = DecisionTelemetry(metrics=metrics)
    record = telemetry.start(request(), router.decide(request(), pods()), {}, 0.0)
    record.after_reply()
    zone = {"policy": "live", "node": "zone"}
    assert value(metrics.registry, "policyd_filter_node_errors_total", **zone) == 3


def test_shadow_agreement_is_counted_per_shadow(tmp_path: Path) -> None:
    metrics = DecisionMetrics()
    served(metrics, tmp_path, count=2)
    served(metrics, tmp_path, count=1, busy=True)
    r = metrics.registry
    shadow = {"policy": "live", "shadow": "fewest-waiting"}
    assert value(r, "policyd_shadow_decisions_total", **shadow, agreement="other-pod") == 2
    # Busy: the live policy sheds, the shadow (no shed node) sheds too: same outcome.
    assert value(r, "policyd_shadow_decisions_total", **shadow, agreement="same-outcome") == 1
    assert value(r, "policyd_shadow_evaluation_duration_seconds_count", policy="live") == 3


def test_stream_errors_by_kind_and_code() -> None:
    metrics = DecisionMetrics()
    telemetry = DecisionTelemetry(metrics=metrics)
    telemetry.stream_error("rejected", "invalid_json")
    telemetry.stream_error("rejected", "invalid_json")
    telemetry.stream_error("aborted", "decided")
    r = metrics.registry
    assert (
        value(r, "policyd_extproc_stream_errors_total", kind="rejected", code="invalid_json") == 2
    )
    assert value(r, "policyd_extproc_stream_errors_total", kind="aborted", code="decided") == 1


def test_reloads_and_the_policies_in_force(tmp_path: Path) -> None:
    store = PolicyStore.open(write_policies(tmp_path))
    metrics = DecisionMetrics()
    metrics.policies_loaded(store.current)
    r = metrics.registry
    live = store.current.policies[0]
    shadow = live.shadows[0]
    assert value(r, "policyd_policy_info", policy="live", version=live.version, role="live") == 1
    assert (
        value(r, "policyd_policy_info", policy=shadow.name, version=shadow.version, role="shadow")
        == 1
    )
    assert value(r, "policyd_policy_last_reload_successful") == 1
    (tmp_path / "live.yaml").write_text("name: live\nfilters:\n  x:\n    keep: pod.nope\n")
    metrics.on_reload(store.reload())
    assert value(r, "policyd_policy_reloads_total", result="rejected") == 1
    assert value(r, "policyd_policy_last_reload_successful") == 0
    (tmp_path / "live.yaml").write_text("name: live\n")
    metrics.on_reload(store.reload())
    assert value(r, "policyd_policy_reloads_total", result="ok") == 1
    assert value(r, "policyd_policy_last_reload_successful") == 1
    new = store.current.policies[0].version
    assert value(r, "policyd_policy_info", policy="live", version=new, role="live") == 1
    assert value(r, "policyd_policy_info", policy="live", version=live.version, role="live") is None


# -- the pool collector, against objects of the pool's shape -------------------------------


@dataclass
class Stats:
    successes: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    last_latency: float | None = None
    last_success_at: float | None = None


@dataclass
class Snapshot:
    pods: tuple[Pod, ...]
    candidates: tuple[Pod, ...]
    ready: bool = True


@dataclass
class FakePool:
    """Has the shape of ``policyd.pool.Pool`` as the collector reads it."""

    current: Snapshot
    stats: dict[str, Stats] = field(default_factory=dict)
    rounds: int = 0
    overruns: int = 0
    panic_rounds: int = 0

    def snapshot(self) -> Snapshot:
        return self.current


def test_the_pool_is_read_at_scrape_time() -> None:
    a = Pod("a", "10.0.0.1:8000", waiting_queue=4, running=2, kv_cache=0.25, active_loras=("x",))
    b = Pod("b", "10.0.0.2:8000", max_loras=4)
    a.load.count = 3
    a.load.prefill_tokens = 2500
    pool = FakePool(
        Snapshot((a, b), (a,)),
        {
            a.address: Stats(successes=10, last_latency=0.004, last_success_at=99.5),
            b.address: Stats(successes=2, failures=5, consecutive_failures=5, last_success_at=None),
        },
        rounds=12,
        overruns=1,
        panic_rounds=3,
    )
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool, clock=lambda: 100.0))
    assert value(registry, "policyd_pool_pods") == 2
    assert value(registry, "policyd_pool_candidate_pods") == 1
    assert value(registry, "policyd_pool_ready") == 1
    assert value(registry, "policyd_pool_panic_rounds_total") == 3
    assert value(registry, "policyd_pool_scrape_rounds_total") == 12
    assert value(registry, "policyd_pool_scrape_overruns_total") == 1
    assert value(registry, "policyd_pod_candidate", model_server_endpoint="a") == 1
    assert value(registry, "policyd_pod_candidate", model_server_endpoint="b") == 0
    assert value(registry, "policyd_pod_waiting_requests", model_server_endpoint="a") == 4
    assert value(registry, "policyd_pod_running_requests", model_server_endpoint="a") == 2
    assert value(registry, "policyd_pod_kv_cache_usage_ratio", model_server_endpoint="a") == 0.25
    assert value(registry, "policyd_pod_active_lora_adapters", model_server_endpoint="a") == 1
    assert value(registry, "policyd_pod_max_lora_adapters", model_server_endpoint="b") == 4
    assert value(registry, "policyd_pod_in_flight_requests", model_server_endpoint="a") == 3
    assert value(registry, "policyd_pod_queued_prefill_tokens", model_server_endpoint="a") == 2500
    assert value(registry, "policyd_pod_queued_prefill_tokens", model_server_endpoint="b") == 0
    assert (
        value(registry, "policyd_pod_scrapes_total", model_server_endpoint="b", result="failure")
        == 5
    )
    assert (
        value(registry, "policyd_pod_scrape_consecutive_failures", model_server_endpoint="b") == 5
    )
    assert (
        value(registry, "policyd_pod_scrape_duration_seconds", model_server_endpoint="a") == 0.004
    )
    assert value(registry, "policyd_pod_metrics_age_seconds", model_server_endpoint="a") == 0.5
    assert value(registry, "policyd_pod_metrics_age_seconds", model_server_endpoint="b") == math.inf
    # A pod that left is no longer reported.
    pool.current = Snapshot((a,), (a,))
    assert value(registry, "policyd_pod_candidate", model_server_endpoint="b") is None


def test_decision_series_of_pods_that_left_are_dropped(tmp_path: Path) -> None:
    metrics = DecisionMetrics()
    served(metrics, tmp_path)
    r = metrics.registry
    assert value(r, "policyd_decisions_total", policy="live", outcome="routed", **ROUTED_A) == 1
    pool = FakePool(Snapshot((Pod("b", "10.0.0.2:8000"),), ()))
    r.register(PoolCollector(pool, decisions=metrics))
    value(r, "policyd_pool_pods")  # a scrape
    assert value(r, "policyd_decisions_total", policy="live", outcome="routed", **ROUTED_A) is None


# -- the endpoint --------------------------------------------------------------------------


def fetch(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def test_the_metrics_endpoint_serves_metrics_and_health(tmp_path: Path) -> None:
    metrics = DecisionMetrics()
    served(metrics, tmp_path)
    ready = [False]
    server = start_metrics_server("127.0.0.1", 0, metrics.registry, ready=lambda: ready[0])
    try:
        status, content_type, body = fetch(server.url + "/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        assert (
            'policyd_decisions_total{model_name="llama",model_server_endpoint="a",'
            'outcome="routed",policy="live"} 1.0' in body
        )
        assert fetch(server.url + "/healthz")[0] == 200
        assert fetch(server.url + "/readyz")[0] == 503
        ready[0] = True
        assert fetch(server.url + "/readyz")[0] == 200
        assert fetch(server.url + "/nope")[0] == 404
    finally:
        server.close()


def test_remembered_walks_do_not_grow_memory_without_bound(tmp_path: Path) -> None:
    """Walks over pods whose load changes at every decision (a new snapshot
    each time, as when pods report new load every scrape): the increments
    remembered per walk must not keep old walks, and their pod-name tuples,
    alive for long."""
    router = router_for(tmp_path)
    telemetry = DecisionTelemetry(metrics=DecisionMetrics())
    asked = request()

    fleet = [Pod(f"pod-{j}", f"10.0.0.{j}:8000", waiting_queue=j % 7) for j in range(100)]

    def serve(count: int) -> None:
        for _ in range(count):
            candidates = tuple(fleet)  # a new snapshot: the router walks anew
            decision = router.decide(asked, candidates)
            record = telemetry.start(asked, decision, {}, 0.0004)
            record.after_reply(router.decide_shadows(decision))
            record.end(
                ExchangeEnd(
                    completed=True,
                    duration_seconds=0.8,
                    first_body_seconds=None,
                    prompt_tokens=None,
                    completion_tokens=None,
                )
            )

    tracemalloc.start()
    try:
        serve(1000)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        serve(3000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1.5 * 1024 * 1024, f"{grown / 1024:.0f} KiB more after 3000 decisions"


# -- the model label, per-model gauges, the build and the process ----------------------------


def routed_for(model: str) -> Decision:
    return Decision(Outcome.ROUTED, "live", "1", model, endpoint="10.0.0.1:8000", pod="a")


def test_request_chosen_model_names_are_capped_and_the_pools_models_pinned() -> None:
    metrics = DecisionMetrics()
    metrics.models.limit = 2
    served_models = Pod("a", "10.0.0.1:8000", base_model="base", active_loras=("sql-lora",))
    pool = FakePool(Snapshot((served_models,), (served_models,)))
    metrics.registry.register(PoolCollector(pool, decisions=metrics))
    value(metrics.registry, "policyd_pool_pods")  # a scrape pins what the pods serve
    for model in ("junk-1", "junk-2", "junk-3", "junk-4", "base", "sql-lora", "x" * 200):
        metrics.decision(routed_for(model), 0.001)
    metrics.decision(routed_for("junk-1"), 0.001)  # admitted once: its own series for good
    counted = {
        labels["model_name"]: sample
        for sample, labels in (
            (s.value, s.labels)
            for family in metrics.registry.collect()
            for s in family.samples
            if s.name == "policyd_decisions_total"
        )
    }
    assert counted == {"junk-1": 2, "junk-2": 1, "other": 3, "base": 1, "sql-lora": 1}


def test_running_waiting_and_saturation_per_model_for_autoscalers() -> None:
    idle = Pod("a", "10.0.0.1:8000", base_model="m", running=1, waiting_queue=0, kv_cache=0.2)
    full = Pod("b", "10.0.0.2:8000", base_model="m", running=7, waiting_queue=10, kv_cache=0.4)
    stale = Pod("c", "10.0.0.3:8000", base_model="m", running=3, waiting_queue=0)
    other = Pod("d", "10.0.0.4:8000", base_model="n", running=2, waiting_queue=1, kv_cache=0.8)
    pool = FakePool(Snapshot((idle, full, stale, other), (idle, full, other)))
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool))
    assert value(registry, "policyd_model_running_requests", model_name="m") == 11
    assert value(registry, "policyd_model_waiting_requests", model_name="m") == 10
    assert value(registry, "policyd_model_running_requests", model_name="n") == 2
    # m: idle 0.25 (KV 0.2 of 0.8), full 2.0 (10 waiting of 5), stale 1: mean 3.25 / 3.
    assert value(registry, "policyd_pool_saturation", model_name="m") == pytest.approx(3.25 / 3)
    assert value(registry, "policyd_pool_saturation", model_name="n") == pytest.approx(1.0)


def test_each_worker_reports_its_build_and_its_process() -> None:
    registry = DecisionMetrics(worker=3).registry
    (build,) = [s for f in registry.collect() for s in f.samples if s.name == "policyd_build_info"]
    assert build.labels["worker"] == "3" and build.labels["version"] and build.value == 1
    assert (value(registry, "process_resident_memory_bytes") or 0) > 0
    assert (value(registry, "process_open_fds") or 0) > 0
