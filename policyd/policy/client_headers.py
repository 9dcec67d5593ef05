"""The request headers of the inference request API that claim a priority or a flow.

The Gateway API Inference Extension named them ``x-gateway-inference-*``;
llm-d's router, where its endpoint picker now lives, reads ``x-llm-d-inference-*``
first and the older spelling after it. policyd reads both in that order:

- the objective: the name of an ``InferenceObjective`` whose ``priority``
  decides the request's criticality (``policyd.pool.inference_objects``);
- the fairness id: the request's flow under flow control when the policy
  names no ``flows.key`` of its own.

Both are a client's claims: the gateway removes them as the request arrives
unless the operator trusts what sets them (``docs/serving.md``, "Trust model").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

OBJECTIVE_HEADERS: Final = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
FAIRNESS_HEADERS: Final = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")


def first_of(headers: Mapping[str, str], names: tuple[str, ...]) -> str:
    """The value of the first of ``names`` the request carries non-empty, else ""."""
    for name in names:
        value = headers.get(name, "").strip()
        if value:
            return value
    return ""
