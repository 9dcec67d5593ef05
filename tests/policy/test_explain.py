"""``policyd explain``: the tree walk in a terminal and as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policyd.cel import POD_FIELDS
from policyd.cli import main
from policyd.policy.inputs import StaticPod
from policyd.pool.file_discovery import parse_pod_file

from .helpers import RULES, write

PODS_JSON = """
[
  {"name": "a", "address": "10.0.0.1:8000", "waiting_queue": 2, "kv_cache": 0.3,
   "active_loras": ["sql-lora"], "max_loras": 2},
  {"name": "b", "address": "10.0.0.2:8000", "waiting_queue": 3, "kv_cache": 0.1,
   "active_loras": ["sql-lora"], "max_loras": 2},
  {"name": "c", "address": "10.0.0.3:8000", "waiting_queue": 0, "kv_cache": 0.5,
   "max_loras": 2}
]
"""
CRITICAL = '{"model": "sql-lora", "headers": {"X-Gateway-Inference-Criticality": "critical"}}'

EXPECTED_TEXT = f"""\
policy    default  ({RULES}/default.yaml, version VERSION)
          The seed LoRA-affinity filter tree; final pick uniformly at random.
request   model=sql-lora target_model=sql-lora criticality=critical
pods      3 candidates

1. sheddable request  [if]  request.criticality == "sheddable"
   false -> else: low queueing

2. low queueing  [keep]  pod.waiting_queue < params.queueing_threshold_lora
   a  true     kept
   b  true     kept
   c  true     kept
   kept 3 of 3 -> on_success: lora affinity

3. lora affinity  [keep]  request.target_model in pod.active_loras
   the pod already runs the requested adapter
   a  true     kept
   b  true     kept
   c  false
   kept 2 of 3 -> on_success: least queuing

4. least queuing  [band]  pod.waiting_queue
   a  2        kept
   b  3
   kept 1 of 2, band [2, 2.5] -> on_success: least kv cache

5. least kv cache  [band]  pod.kv_cache
   a  0.3      kept
   kept 1 of 1, band [0.3, 0.3] -> on_success: end of the walk

pick      a (10.0.0.1:8000) by random among 1
"""


def explain(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    policy: Path,
    request: str,
    *extra: str,
) -> tuple[int, str]:
    pods = write(tmp_path, PODS_JSON, "pods.json")
    request_file = write(tmp_path, request, "request.json")
    arguments = ["--policy", str(policy), "--pods", str(pods), "--request", str(request_file)]
    code = main(["explain", *arguments, *extra])
    return code, capsys.readouterr().out


def test_text_shows_every_node_with_each_pods_value_and_the_pick(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = explain(tmp_path, capsys, RULES / "default.yaml", CRITICAL)
    assert code == 0
    version = out.split("version ", 1)[1].split(")", 1)[0]
    assert out == EXPECTED_TEXT.replace("VERSION", version)


def test_text_shows_the_score_table_and_fallbacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = explain(tmp_path, capsys, RULES / "scorers.yaml", CRITICAL)
    assert code == 0
    # a: 2 * (1 - 2/50) + 0.7 + 1.5 = 4.12; b: 2 * 0.94 + 0.9 + 1.5 = 4.28; c: 2 + 0.5 + 0.75
    assert out.splitlines()[-7:] == [
        "scores (max-score, each clamped to [0, 1], times its weight)",
        "   pod  total  short queue x2  free kv cache x1  lora affinity x1.5",
        "   b    4.28   0.94            0.9               1",
        "   a    4.12   0.96            0.7               1",
        "   c    3.25   1               0.5               0.5",
        "",
        "pick      b (10.0.0.2:8000) by max-score among 3; "
        "fallbacks a (10.0.0.1:8000), c (10.0.0.3:8000)",
    ]


def test_shed_is_explained_with_its_status_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    busy = '[{"name": "hot", "waiting_queue": 9}]'
    pods = write(tmp_path, busy, "busy.json")
    sheddable = '{"model": "m", "headers": {"x-gateway-inference-criticality": "sheddable"}}'
    request = write(tmp_path, sheddable, "request.json")
    policy = str(RULES / "default.yaml")
    code = main(["explain", "--policy", policy, "--pods", str(pods), "--request", str(request)])
    out = capsys.readouterr().out
    assert code == 0
    assert "2. has capacity  [keep]" in out
    assert "   kept 0 of 1 -> on_failure: drop request" in out
    assert out.endswith("outcome   shed (429): dropping request due to limited backend resources\n")


def test_json_carries_nodes_values_scores_and_the_pick(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = explain(tmp_path, capsys, RULES / "default.yaml", CRITICAL, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["outcome"] == "routed"
    assert data["status"] == 200
    assert (data["pod"], data["endpoint"]) == ("a", "10.0.0.1:8000")
    assert data["request"] == {
        "model": "sql-lora",
        "target_model": "sql-lora",
        "criticality": "critical",
    }
    assert [n["node"] for n in data["nodes"]] == [
        "sheddable request",
        "low queueing",
        "lora affinity",
        "least queuing",
        "least kv cache",
    ]
    band = data["nodes"][3]
    assert band["kind"] == "band"
    assert band["values"] == {"a": "2", "b": "3"}
    assert band["kept"] == ["a"]
    assert band["band"] == [2, 2.5]
    assert data["survivors"] == ["a"]
    assert data["scores"] == []

    code, out = explain(tmp_path, capsys, RULES / "scorers.yaml", CRITICAL, "--json")
    scored = json.loads(out)
    assert scored["scores"][0] == {
        "pod": "b",
        "total": pytest.approx(4.28),
        "scorers": {"short queue": "0.94", "free kv cache": "0.9", "lora affinity": "1"},
    }
    assert scored["fallback_pods"] == ["a", "c"]


def test_cel_errors_per_pod_are_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = write(tmp_path, "filters:\n  zone:\n    keep: pod.labels['zone'] == 'x'\n")
    code, out = explain(tmp_path, capsys, policy, '{"model": "m"}')
    assert code == 0
    assert "   a  error: " in out
    assert "zone" in out.split("   a  error: ", 1)[1].splitlines()[0]
    assert out.endswith(
        "outcome   shed (429): no pod passed the filters (the walk ended at 'zone')\n"
    )


def test_bad_inputs_are_reported_with_positions_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pods = write(tmp_path, '[{"name": "a", "waiting_queue": "lots"}, {"nme": "b"}]', "p.json")
    request = write(tmp_path, '{"model": "m", "criticality": "critical"}', "r.json")
    policy = str(RULES / "default.yaml")
    code = main(["explain", "--policy", policy, "--pods", str(pods), "--request", str(request)])
    out = capsys.readouterr().out.replace(str(tmp_path) + "/", "")
    assert code == 1
    assert out.splitlines() == [
        "p.json:1:33: pod field 'waiting_queue' must be an integer, not a string",
        "p.json:1:43: unknown field 'nme' in a pod; did you mean 'name'?",
        "p.json:1:42: a pod needs a 'name'",
        "r.json:1:16: 'criticality' is decided by the policy (criticality from the "
        "x-gateway-inference-criticality header or the model; target_model from the "
        "model's targets)",
    ]


def test_hand_written_pods_carry_every_pod_field_of_the_cel_schema() -> None:
    assert set(StaticPod.__slots__) == {f.name for f in POD_FIELDS}


def test_serves_pod_file_is_read_as_serve_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file ``serve --pods`` takes explains the same pods, labels and addresses included."""
    served = "pods:\n  - name: vllm-0\n    address: 10.0.0.11:8000\n    labels: {zone: a}\n"
    served += "  - name: vllm-1\n    address: '[fd00::12]:8000'\n"
    pods = write(tmp_path, served, "pods.yaml")
    request = write(tmp_path, '{"model": "m"}', "request.json")
    policy = str(RULES / "default.yaml")
    argv = ["explain", "--policy", policy, "--pods", str(pods), "--request", str(request), "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    identities = {i.name: i.address for i in parse_pod_file(served, "pods.yaml")}
    assert data["survivors"] == sorted(identities)
    assert data["endpoint"] == identities[data["pod"]]
