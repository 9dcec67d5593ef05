"""``policyd explain`` shows each pod's predicted latencies for a policy that reads them,
from pods written by hand, and routes on them as the service would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policyd.cli import main

from .helpers import write

POLICY = """\
name: quick
filters:
  meets the objective:
    keep: pod.predicted_ttft_ms >= 0.0 && pod.predicted_ttft_ms <= request.slo_ttft_ms
"""
PODS = """\
[{"name": "slow", "address": "10.0.0.1:8000", "predicted_ttft_ms": 900.0,
  "predicted_tpot_ms": 40.0},
 {"name": "quick", "address": "10.0.0.2:8000", "predicted_ttft_ms": 120.0,
  "predicted_tpot_ms": 18.5},
 {"name": "new", "address": "10.0.0.3:8000"}]
"""
REQUEST = '{"model": "m", "slo_ttft_ms": 300.0}'


def run(tmp_path: Path, capsys: pytest.CaptureFixture[str], policy: str, *extra: str) -> str:
    arguments = [
        "--policy",
        str(write(tmp_path, policy, "policy.yaml")),
        "--pods",
        str(write(tmp_path, PODS, "pods.json")),
        "--request",
        str(write(tmp_path, REQUEST, "request.json")),
    ]
    assert main(["explain", *arguments, *extra]) == 0
    return capsys.readouterr().out


def test_text_lists_each_pods_predictions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run(tmp_path, capsys, POLICY)
    assert "predicted (ms; - where the pod has no prediction yet)" in out
    assert "   slow   ttft 900      tpot 40" in out
    assert "   quick  ttft 120      tpot 18.5" in out
    assert "   new    ttft -        tpot -" in out
    assert "pick      quick (10.0.0.2:8000)" in out


def test_json_carries_them_and_a_policy_not_reading_them_shows_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = json.loads(run(tmp_path, capsys, POLICY, "--json"))
    assert document["predictions"]["quick"] == {"ttft_ms": 120.0, "tpot_ms": 18.5}
    assert document["predictions"]["new"] == {"ttft_ms": None, "tpot_ms": None}
    plain = "name: plain\nfilters:\n  all:\n    keep: true\n"
    assert "predicted" not in run(tmp_path, capsys, plain)
    assert json.loads(run(tmp_path, capsys, plain, "--json"))["predictions"] == {}
