"""Attack: a pod publishes thousands of LoRA adapters to a rule that iterates per adapter.

The load-time bound counts input lists as 100 elements, so a rule doing 100
steps per adapter loads; a hostile or broken model server that lists 20,000
adapters then makes one evaluation iterate 2 million times, on every request
and pod. Each evaluation now counts the elements its comprehensions iterate
over and stops with a ``CelEvalError`` past the budget.
"""

from __future__ import annotations

import pytest
from cel_expr_python import cel

from policyd.cel import CelEvalError, Environment, pod_type, request_type
from policyd.pool.pod import Pod

ENVIRONMENT = Environment(
    {
        "pod": pod_type(),
        "request": request_type(),
        "params.models": cel.Type.List(cel.Type.STRING),
    }
)
MODELS = [f"model-{i}" for i in range(100)]


def test_a_pod_with_twenty_thousand_adapters_stops_at_the_iteration_budget() -> None:
    program = ENVIRONMENT.compile(
        "pod.active_loras.exists(a, params.models.exists(m, m == a))",
        constants={"params.models": MODELS},
    )
    hostile = Pod(name="p", address="10.0.0.1:8000", active_loras=[f"x{i}" for i in range(20_000)])
    with pytest.raises(CelEvalError, match="cost budget: this evaluation iterated"):
        program.evaluate({"pod": hostile, "request": None})
    usual = Pod(name="q", address="10.0.0.2:8000", active_loras=["x", "model-7"])
    assert program.evaluate({"pod": usual, "request": None}) is True
