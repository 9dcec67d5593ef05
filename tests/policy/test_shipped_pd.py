"""rules/pd.yaml's decode stage is rules/lora-prefix.yaml's: a policy file cannot include
another, so pd.yaml carries a copy of lora-prefix's scorers and pick, and this test
fails when the two drift apart."""

from __future__ import annotations

from typing import Any

import yaml

from policyd.policy import PolicyStore

from .helpers import RULES

DECODE_STAGE = ("match", "score", "pick")  # what pd.yaml shares with lora-prefix.yaml


def _stage(name: str) -> dict[str, Any]:
    policy = yaml.safe_load((RULES / name).read_text())
    return {key: policy[key] for key in DECODE_STAGE}


def test_pd_yaml_picks_the_decode_pod_as_lora_prefix_yaml_picks_a_pod() -> None:
    assert _stage("pd.yaml") == _stage("lora-prefix.yaml")
    pd = yaml.safe_load((RULES / "pd.yaml").read_text())
    lora_prefix = yaml.safe_load((RULES / "lora-prefix.yaml").read_text())
    assert {k: v for k, v in pd["params"].items() if k in lora_prefix["params"]} == (
        lora_prefix["params"]
    )


def test_pd_yaml_loads_as_a_two_stage_policy() -> None:
    (policy,) = PolicyStore.open(RULES / "pd.yaml").current.policies
    assert policy.prefill is not None
    assert policy.roles == frozenset({"decode", "both"})
    assert policy.reads_prefix  # `when` and the scorers read the prefix match
