"""The client's latency objectives reach policies as ``request.slo_ttft_ms`` /
``request.slo_tpot_ms``: read from llm-d's headers (or their older aliases), a bad
value a 400, and a policy routes on them through the router."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from policyd.extproc.errors import RequestError
from policyd.extproc.openai import parse_body
from policyd.policy import Router
from policyd.policy.loader import load_policy_set
from policyd.pool.pod import Pod

BODY = json.dumps({"model": "m", "prompt": "hello"}).encode()


def parsed(headers: dict[str, str]) -> tuple[float, float]:
    request = parse_body(BODY, "/v1/completions", headers=headers).request
    return request.slo_ttft_ms, request.slo_tpot_ms


def test_the_llm_d_headers_and_their_aliases_fill_the_fields() -> None:
    assert parsed({}) == (0.0, 0.0)
    assert parsed({"x-llm-d-slo-ttft-ms": "500", "x-llm-d-slo-tpot-ms": "25.5"}) == (500.0, 25.5)
    assert parsed({"x-slo-ttft-ms": "800", "x-slo-tpot-ms": "40"}) == (800.0, 40.0)
    # llm-d's own name wins over the older alias.
    assert parsed({"x-llm-d-slo-ttft-ms": "300", "x-slo-ttft-ms": "900"}) == (300.0, 0.0)


@pytest.mark.parametrize("value", ["fast", "0", "-5", "nan", "inf", "1e12", "9" * 40, ""])
def test_a_bad_objective_is_a_400_naming_the_header(value: str) -> None:
    with pytest.raises(RequestError) as caught:
        parsed({"x-llm-d-slo-tpot-ms": value})
    assert caught.value.status == 400
    assert "x-llm-d-slo-tpot-ms" in str(caught.value)


def test_a_policy_routes_on_the_objective(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "filters:\n"
        "  by objective:\n"
        "    if: request.slo_ttft_ms > 0.0 && request.slo_ttft_ms < 1000.0\n"
        "    then: fast\n"
        "    else: slow\n"
        "  fast:\n"
        '    keep: pod.name == "fast"\n'
        "  slow:\n"
        '    keep: pod.name == "slow"\n'
    )
    router = Router(load_policy_set(tmp_path / "p.yaml"), rng=random.Random(0))
    pods = (Pod("fast", "10.0.0.1:8000"), Pod("slow", "10.0.0.2:8000"))
    for headers, pod in (({"x-slo-ttft-ms": "400"}, "fast"), ({}, "slow")):
        request = parse_body(BODY, "/v1/completions", headers=headers).request
        assert router.decide(request, pods).pod == pod
