"""The wiring of benchmarks/virtual_routing.py, which quality.py and flow_quality.py route with:
simulator view -> Pod -> real Router -> pod index.

Not a quality claim (that is the benchmark's job): these check that every
field the router sees comes from the simulated pod, that policyd's in-flight
count reaches the policy live during a run, and that a short virtual run with
the shipped default policy routes and completes its requests.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from pathlib import Path

import pytest
from benchmarks_support import load_benchmark

from policyd.cel import POD_FIELDS
from policyd.cel.values import Duration
from policyd.policy.loader import load_policy_set
from policyd.pool.pod import Pod
from policyd.sim.experiment import PodView, RoutedRequest, SeedWorkload, run_experiment

REPO = Path(__file__).resolve().parents[2]


quality = load_benchmark("quality")
routing = load_benchmark("virtual_routing")

VIEW = PodView(
    index=4,
    name="vllm-4",
    waiting=7,
    running=21,
    kv_cache_usage=0.625,
    running_adapters=("adapter-1", "adapter-5"),
    waiting_adapters=("adapter-9",),
    max_loras=4,
    metrics_age=0.075,
    in_flight=31,
    preemptions=2,
)
# A few requests over few connections: seconds of virtual time, well under a second of wall.
SHORT = SeedWorkload(requests=48, connections=12, max_tokens=120)


def test_every_field_of_the_view_is_carried_over() -> None:
    pod = routing.pod_from_view(VIEW)
    assert isinstance(pod, Pod)
    assert pod.name == "vllm-4"
    assert pod.address == "127.0.0.1:8004"  # where `policyd sim --base-port 8000` serves it
    assert pod.labels == {"app": "vllm"}
    assert pod.waiting_queue == 7
    assert pod.running == 21
    assert pod.kv_cache == 0.625
    assert pod.active_loras == ("adapter-1", "adapter-5")
    assert pod.waiting_loras == ("adapter-9",)
    assert pod.max_loras == 4
    assert pod.lora_info_known is True  # a simulated pod's view always carries max_loras
    assert pod.metrics_age == Duration(75_000_000)
    assert pod.in_flight == 31
    assert pod.num_preemptions == 2


def test_no_pod_field_is_left_at_an_idle_pods_value() -> None:
    # Every field of the CEL pod schema differs from a bare Pod's: none was forgotten.
    # (lora_info_known is true for both: a view always knows the pod's LoRA state; the
    # router lays the prefix and prediction fields over the pod per request; a simulated
    # pod serves both P/D stages, as a pod without a role label does; the queued prefill
    # is policyd's own count, kept by the runner that routes on it, slo_quality.py, over
    # the pod this makes: test_slo_quality.py checks it there.)
    pod = routing.pod_from_view(VIEW, labels={"pool": "sim"})
    bare = Pod(name="", address="")
    forgotten = [
        f.name
        for f in POD_FIELDS
        if f.name not in ("lora_info_known", "role", "queued_prefill_tokens")
        and f.origin not in ("prefix", "prediction")
        and getattr(pod, f.name) == getattr(bare, f.name)
    ]
    assert forgotten == []
    assert pod.labels == {"pool": "sim"}


def test_a_prefix_renames_the_pod_and_nothing_else() -> None:
    renamed = routing.pod_from_view(VIEW, prefix="pool-a-")
    assert renamed.name == "pool-a-4"
    assert renamed == dataclasses.replace(routing.pod_from_view(VIEW), name="pool-a-4")
    assert renamed.in_flight == 31  # InFlight is not compared by ==


def test_each_pod_gets_its_own_address_so_the_endpoint_maps_back() -> None:
    views = [PodView(i, f"vllm-{i}", 0, 0, 0.0, (), (), 4, 0.0, 0) for i in range(6)]
    addresses = {routing.pod_from_view(view).address for view in views}
    assert len(addresses) == 6


def test_the_routing_function_returns_the_index_of_the_pod_the_policy_chose(
    tmp_path: Path,
) -> None:
    policy = tmp_path / "busiest.yaml"
    policy.write_text("score:\n  busy:\n    expr: double(pod.running) / 100.0\n")
    route = routing.PolicyRouting(policy, seed=0)
    views = [
        PodView(i, f"vllm-{i}", 0, running, 0.0, (), (), 4, 0.0, 0)
        for i, running in enumerate([3, 9, 50, 1])
    ]
    request = RoutedRequest(0, "adapter-0", 17, 750, 0.0)
    assert route(request, views, random.Random(0)) == 2
    assert route(request, views[::-1], random.Random(0)) == 2  # by identity, not position
    assert route.decisions == 2
    renamed = routing.PolicyRouting(policy, seed=0, prefix="pool-a-")
    assert renamed(request, views, random.Random(0)) == 2


def test_in_flight_reaches_the_policy_live_during_a_run(tmp_path: Path) -> None:
    # All 12 connections open at t=0, on one snapshot of idle pods: only the
    # in-flight counts differ between those decisions. Least-in-flight routing
    # can split them exactly evenly only if each decision sees the ones before.
    policy = tmp_path / "least-in-flight.yaml"
    policy.write_text("score:\n  light:\n    expr: 1.0 - double(pod.in_flight) / 100.0\n")
    result = run_experiment(routing.PolicyRouting(policy, seed=3), workload=SHORT, seed=3)
    first = [record.pod for record in result.records if record.sent == 0.0]
    assert len(first) == SHORT.connections
    assert Counter(first) == {pod: 2 for pod in range(6)}


def test_a_short_run_with_the_shipped_default_policy_routes_and_completes() -> None:
    route = routing.PolicyRouting(REPO / "rules" / "default.yaml", seed=1)
    result = run_experiment(route, workload=SHORT, seed=1)
    assert route.decisions == SHORT.requests  # every request went through Router.decide
    assert all(record.pod is not None for record in result.records)
    assert len({record.pod for record in result.records}) == 6
    assert result.completed == SHORT.requests
    assert result.output_tokens_per_s > 0


def test_the_default_policy_serves_the_published_clients_unmarked_requests() -> None:
    # The published client sends no criticality header. 100 connections at
    # once load every pod past the spare-capacity node of the sheddable branch,
    # so a default.yaml that treated unmarked requests as sheddable would shed
    # (NotRoutedError) from about the 101st request on.
    burst = SeedWorkload(requests=150, connections=100, max_tokens=120)
    route = routing.PolicyRouting(REPO / "rules" / "default.yaml", seed=1, headers={})
    result = run_experiment(route, workload=burst, seed=1)
    assert route.decisions == burst.requests
    assert result.completed == burst.requests


def test_a_policy_that_sheds_stops_the_run_with_a_clear_error(tmp_path: Path) -> None:
    policy = tmp_path / "shed-all.yaml"
    policy.write_text("filters:\n  nobody:\n    shed: closed for maintenance\n")
    with pytest.raises(routing.NotRoutedError, match=r"429: closed for maintenance"):
        run_experiment(routing.PolicyRouting(policy, seed=0), workload=SHORT, seed=0)


@pytest.mark.parametrize(
    "path", sorted((REPO / "benchmarks" / "ablations").glob("*.yaml")), ids=lambda p: p.name
)
def test_the_ablation_policies_still_load(path: Path) -> None:
    assert load_policy_set(path).warnings == ()
