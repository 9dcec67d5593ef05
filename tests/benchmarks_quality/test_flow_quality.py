"""The wiring of benchmarks/flow_quality.py: flow control on the simulator's virtual clock.

Not a quality claim (that is the benchmark's job): a short run over capacity
holds requests, answers or serves every one of them, and lets a small tenant
through a flood; the contender without flow control holds nothing.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def flow_quality() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("flow_quality")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_a_short_run_over_capacity_holds_and_loses_nothing(
    flow_quality: ModuleType, tmp_path: Path
) -> None:
    field = flow_quality.contenders(tmp_path, tmp_path / "absent.yaml", flow_quality.SATURATED)
    assert [c.name for c in field] == ["none", "shed-only", "flow"]
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
