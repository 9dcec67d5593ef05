"""A request field declared once reaches policies: filled by the parser from the
body, the headers or the path, routed on by a policy through the router, and
written by hand for ``policyd test`` / ``explain``; the fields the policy decides
are its own. ``prompt_tokens`` is the example.

To add a request field, copy these tests for it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from policyd.extproc.openai import parse_body, request_without_body
from policyd.fields import REQUEST_FIELDS
from policyd.policy import Router
from policyd.policy.diagnostics import Diagnostic
from policyd.policy.inputs import read_request
from policyd.policy.loader import load_policy_set
from policyd.policy.request import Request
from policyd.policy.source import Source, parse_yaml
from policyd.pool.pod import Pod

POLICY = """\
filters:
  by length:
    if: request.prompt_tokens > 100
    then: big
    else: small
  big:
    keep: pod.name == "big"
  small:
    keep: pod.name == "small"
"""
PODS = (Pod("big", "10.0.0.1:8000"), Pod("small", "10.0.0.2:8000"))


def test_a_parsed_field_reaches_the_policy_through_the_router(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    router = Router(load_policy_set(tmp_path / "policy.yaml"), rng=random.Random(0))
    for prompt, endpoint in (("x" * 800, "10.0.0.1:8000"), ("short", "10.0.0.2:8000")):
        raw = json.dumps({"model": "m", "prompt": prompt}).encode()
        request = parse_body(raw, "/v1/completions", headers={"x-request-id": "r"}).request
        assert router.decide(request, PODS).endpoint == endpoint


def test_a_request_has_every_declared_field_with_its_default() -> None:
    for request in (Request(model="m"), request_without_body({}, "/v1/models")):
        for field in REQUEST_FIELDS:
            if field.name not in ("model", "path"):
                assert getattr(request, field.name) == field.default, field.name


def test_a_request_written_by_hand_reads_the_field_and_not_the_policys() -> None:
    root, _ = parse_yaml(Source("request.yaml", "model: m\nprompt_tokens: 120\ncriticality: x\n"))
    assert root is not None
    diagnostics: list[Diagnostic] = []
    request = read_request(root, diagnostics)
    assert request is not None and request.prompt_tokens == 120
    assert [d.message for d in diagnostics] == [
        "'criticality' is decided by the policy (criticality from the "
        "x-gateway-inference-criticality header or the model; target_model from "
        "the model's targets)"
    ]
