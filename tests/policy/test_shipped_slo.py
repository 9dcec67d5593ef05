"""rules/slo.yaml is rules/lora-prefix.yaml with latency objectives: a policy file cannot
include another, so slo.yaml carries a copy of lora-prefix's scorers and params, and
this test fails when the two drift apart."""

from __future__ import annotations

from typing import Any

import yaml

from policyd.policy import PolicyStore

from .helpers import RULES

OWN = ("name", "description", "filters")  # what slo.yaml says on its own, besides a scorer
SLO_SCORERS = ("quick first token", "leaves the quick pods")
SLO_PARAMS = ("slow_first_token_ms",)


def _policy(name: str) -> dict[str, Any]:
    policy: dict[str, Any] = yaml.safe_load((RULES / name).read_text())
    return policy


def test_slo_yaml_is_lora_prefix_yaml_with_its_filters_scorers_and_params() -> None:
    slo, combined = _policy("slo.yaml"), _policy("lora-prefix.yaml")
    score = dict(slo["score"])
    for name in SLO_SCORERS:
        assert "pod.predicted_ttft_ms" in score.pop(name)["expr"]
    assert score == combined["score"]
    params = dict(slo["params"])
    for name in SLO_PARAMS:
        params.pop(name)
    assert params == combined["params"]
    slo.pop("params")
    combined.pop("params")
    rest = {k: v for k, v in slo.items() if k not in (*OWN, "score")}
    assert rest == {k: v for k, v in combined.items() if k not in (*OWN, "score")}


def test_slo_yaml_reads_the_predictions_and_so_is_served_with_them() -> None:
    (policy,) = PolicyStore.open(RULES / "slo.yaml").current.policies
    assert policy.name == "slo" and policy.reads_prediction and policy.reads_prefix
