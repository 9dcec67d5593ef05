"""The wiring of benchmarks/flow_quality.py: flow control on the simulator's virtual clock.

Not a quality claim (that is the benchmark's job): a short run over capacity
holds requests, answers or serves every one of them, and lets a small tenant
through a flood; the contender without flow control holds nothing; every
profile's pods can be driven, the calibration overloading each.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from benchmarks_support import BENCHMARKS, load_benchmark

from policyd.sim.profile import get_profile


@pytest.fixture(scope="module")
def flow_quality() -> ModuleType:
    return load_benchmark("flow_quality")


def test_a_short_run_over_capacity_holds_and_loses_nothing(
    flow_quality: ModuleType, tmp_path: Path
) -> None:
    field = flow_quality.contenders(tmp_path, tmp_path / "absent.yaml", flow_quality.SATURATED)
    assert [c.name for c in field] == ["none", "shed-only", "flow", "rules/flow.yaml"]
    tenants = flow_quality.Tenants()
    flow = flow_quality.run_one(field[2], tenants, 30.0, 20.0, 1)
    assert flow.peak_held > 0 and flow.lost == 0
    assert flow.total.completed + flow.total.refused == flow.total.offered
    assert flow.classes["tenant-b"].goodput == 1.0
    none = flow_quality.run_one(field[0], tenants, 30.0, 20.0, 1)
    assert none.peak_held == 0 and none.total.refused == 0
    assert flow.classes["tenant-b"].ttft_p90 < none.classes["tenant-b"].ttft_p90 / 5


def test_the_seed_experiment_runs_through_flow_control(
    flow_quality: ModuleType, tmp_path: Path
) -> None:
    policy = flow_quality.flow_policy(
        flow_quality.RULES / "lora-balanced.yaml", tmp_path, "pod.in_flight >= 10"
    )
    run = flow_quality.SeedFlowRun(policy, 1)
    result = run.run()
    assert run.peak_held > 0  # 100 connections over 6 pods of 10: some wait at the gateway
    assert result.completed > 300
    assert len(run.ttft_s(result)) == result.completed


def test_a_flow_run_shows_the_policy_pods_of_its_own_profile(
    flow_quality: ModuleType, tmp_path: Path
) -> None:
    profile = get_profile("l4-llama3.1-8b")
    field = flow_quality.contenders(tmp_path, tmp_path / "absent.yaml", flow_quality.SATURATED)
    requests = flow_quality.Tenants().requests(rate=5.0, duration_s=2.0, seed=3)
    run = flow_quality.FlowRun(field[2], requests, 3, profile)
    pods = run._snapshot().candidates
    assert [p.kv_cache_blocks for p in pods] == [profile.num_gpu_blocks] * len(pods)
    assert {p.base_model for p in pods} == {profile.base_model}
    assert run.pods[0].engine.profile is profile


@pytest.mark.parametrize("name", ["l4-llama2-7b", "l4-llama3.1-8b"])
def test_the_calibration_rate_overloads_the_pool_of_each_profile(
    flow_quality: ModuleType, name: str
) -> None:
    # The capacity is what `none` completes while offered more than it serves:
    # at the derived rate the pool must fall well behind the arrivals.
    profile = get_profile(name)
    offered = flow_quality.calibration_rate(profile, flow_quality.Overload())
    none = flow_quality.Contender("none", flow_quality.RULES / "default.yaml")
    run = flow_quality.run_one(none, flow_quality.Overload(), offered, 10.0, 5, profile=profile)
    assert run.completed_per_s < 0.5 * offered


def test_the_flow_workloads_take_a_profile_on_the_command_line() -> None:
    command = [
        sys.executable,
        str(BENCHMARKS / "quality.py"),
        "--workload",
        "tenants",
        "--profile",
        "l4-llama3.1-8b",
        "--seeds",
        "1",
        "--duration",
        "10",
        "--multiples",
        "2",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "6 pods of l4-llama3.1-8b" in done.stdout
    assert "small tenant goodput" in done.stdout
