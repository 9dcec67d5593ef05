"""rules/flow.yaml is rules/lora-prefix.yaml with a flow section: a policy file cannot
include another, so flow.yaml carries a copy of lora-prefix's scorers, and this test
fails when the two drift apart."""

from __future__ import annotations

from typing import Any

import yaml

from policyd.policy import PolicyStore

from .helpers import RULES

OWN = ("name", "description", "flow")  # what flow.yaml may say on its own


def _routing(name: str) -> dict[str, Any]:
    policy = yaml.safe_load((RULES / name).read_text())
    return {key: value for key, value in policy.items() if key not in OWN}


def test_flow_yaml_routes_as_lora_prefix_yaml() -> None:
    flow, combined = _routing("flow.yaml"), _routing("lora-prefix.yaml")
    assert flow == combined
    assert "flow" not in yaml.safe_load((RULES / "lora-prefix.yaml").read_text())


def test_flow_yaml_loads_with_its_flow_section() -> None:
    (policy,) = PolicyStore.open(RULES / "flow.yaml").current.policies
    assert policy.name == "flow"
    assert policy.flow is not None
    assert [band.name for band in policy.flow.bands] == ["critical", "standard", "sheddable"]
