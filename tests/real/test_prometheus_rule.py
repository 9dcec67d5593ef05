"""The chart's PrometheusRule, rendered by the real ``helm``: the rule file as shipped.

The rules' own tests (metric names, labels, matchers) are in
``tests/telemetry/test_assets.py``; this checks what the chart makes of the
file: off by default, on with ``prometheusRule.enabled``, every rule of
``files/prometheus-alerts.yaml`` in its ``spec`` unchanged but for the
runbook links, which point where ``prometheusRule.runbookBaseUrl`` says, and
Prometheus's ``{{ $labels }}`` left for Prometheus to expand.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "istio" / "helm" / "policyd"
RULES = CHART / "files" / "prometheus-alerts.yaml"


def rendered(tool: Callable[[str], str], *values: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [tool("helm"), "template", "policyd", str(CHART), "-n", "inference", *values],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def test_the_rule_is_off_by_default(tool: Callable[[str], str]) -> None:
    assert not [d for d in rendered(tool) if d["kind"] == "PrometheusRule"]


def test_the_rule_carries_the_shipped_alerts_with_runbooks_where_told(
    tool: Callable[[str], str],
) -> None:
    base = "https://docs.example.com/policyd/v1/"
    objects = rendered(
        tool,
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        f"prometheusRule.runbookBaseUrl={base}",
        "--set",
        "prometheusRule.labels.release=kube-prometheus",
    )
    (rule,) = [d for d in objects if d["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    shipped = yaml.safe_load(RULES.read_text())
    for group in shipped["groups"]:
        for alert in group["rules"]:
            link = alert["annotations"]["runbook_url"]
            assert link.startswith("docs/observability.md#")
            alert["annotations"]["runbook_url"] = base + link.removeprefix("docs/")
    assert rule["spec"] == shipped
    summaries = [r["annotations"]["summary"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert any("{{ $labels.model_server_endpoint }}" in s for s in summaries)
