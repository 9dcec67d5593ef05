"""InferenceObjective and InferenceModelRewrite objects applied to requests over real gRPC.

A real ``ExtProcServer`` and ``Router`` over a policy set; the objects are
given as ``policyd.pool.inference_objects`` builds them from the API server
(``tests/pool/test_inference_objects.py`` follows them there).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from extproc_support import EnvoySide, RecordingTelemetry, Snapshot, request_body, request_headers

from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.extproc.objectives import applied
from policyd.extproc.openai import parse_body
from policyd.policy import Router
from policyd.policy.loader import load_policy_set
from policyd.pool.inference_objects import (
    NO_OBJECTS,
    InferenceObjects,
    combine,
    objective_of,
    rules_of,
)
from policyd.pool.pod import Pod

POOL = "vllm-pool"
# Requests for base-v2 go to pod-v2; the criticality decides the pod for the rest.
POLICIES = {
    "v2.yaml": "match: {models: [base-v2]}\nfilters:\n  v2: {keep: 'pod.name == \"pod-v2\"'}\n",
    "any.yaml": """\
match: {models: ["*"]}
filters:
  by criticality:
    if: request.criticality == "critical"
    then: gold
    else: plain
  gold: {keep: 'pod.name == "pod-gold"'}
  plain: {keep: 'pod.name == "pod-plain"'}
""",
}
PODS = (
    Pod("pod-gold", "10.0.0.1:8000"),
    Pod("pod-plain", "10.0.0.2:8000"),
    Pod("pod-v2", "10.0.0.3:8000"),
)


def objects() -> InferenceObjects:
    def of(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        metadata = {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"}
        return {"kind": kind, "metadata": metadata, "spec": {"poolRef": {"name": POOL}, **spec}}

    premium = objective_of(of("InferenceObjective", "premium", {"priority": 10}), POOL)
    batch = objective_of(of("InferenceObjective", "batch", {"priority": -1}), POOL)
    alias = {"matches": [{"model": {"value": "base"}}], "targets": [{"modelRewrite": "base-v2"}]}
    rules = rules_of(of("InferenceModelRewrite", "alias", {"rules": [alias]}), POOL)
    assert premium is not None and batch is not None and rules is not None
    return combine(dict([premium, batch]), {"alias": rules})


@pytest.fixture
async def gateway(tmp_path: Path) -> Any:
    for name, text in POLICIES.items():
        (tmp_path / name).write_text(text)
    router = Router(load_policy_set(tmp_path), rng=random.Random(0))
    current = objects()
    server = ExtProcServer(
        lambda: router,
        lambda: Snapshot(PODS),
        telemetry=RecordingTelemetry(),
        options=ServerOptions(port=0),
        objects=lambda: current,
    )
    port = await server.start()
    envoy = EnvoySide(port)
    yield envoy
    await envoy.close()
    await server.stop(0)


async def route(envoy: EnvoySide, model: str, headers: dict[str, str]) -> tuple[str, Any]:
    """The destination and the body sent upstream (None: unchanged)."""
    _, reply = await envoy.exchange(
        request_headers(headers), request_body({"model": model, "prompt": "hi"})
    )
    mutation = reply.request_body.response
    destination = {
        h.header.key: h.header.raw_value.decode() for h in mutation.header_mutation.set_headers
    }["x-gateway-destination-endpoint"]
    body = mutation.body_mutation.body
    return destination, json.loads(body) if body else None


async def test_the_objective_a_request_names_decides_its_criticality(gateway: Any) -> None:
    envoy = gateway
    new, old = "x-llm-d-inference-objective", "x-gateway-inference-objective"
    assert (await route(envoy, "m", {new: "premium"}))[0] == "10.0.0.1:8000"
    assert (await route(envoy, "m", {old: "premium"}))[0] == "10.0.0.1:8000"
    # llm-d's spelling first; the objective before the criticality header
    both = {new: "batch", old: "premium", "x-gateway-inference-criticality": "critical"}
    assert (await route(envoy, "m", both))[0] == "10.0.0.2:8000"
    # a name policyd follows no objective of changes nothing
    unknown = {new: "nobody", "x-gateway-inference-criticality": "critical"}
    assert (await route(envoy, "m", unknown))[0] == "10.0.0.1:8000"


async def test_a_rewritten_model_is_routed_as_its_target_and_sent_so(gateway: Any) -> None:
    envoy = gateway
    destination, body = await route(envoy, "base", {})
    assert destination == "10.0.0.3:8000"  # the policy of base-v2
    assert body == {"model": "base-v2", "prompt": "hi"}
    destination, body = await route(envoy, "other", {})
    assert (destination, body) == ("10.0.0.2:8000", None)  # no rule: untouched


def test_no_objects_leave_the_request_as_parsed() -> None:
    headers = {"x-llm-d-inference-objective": "premium"}
    body = parse_body(b'{"model": "base", "prompt": "x"}', "/v1/completions", headers=headers)
    assert applied(body, NO_OBJECTS, random.Random(0)) is body
    changed = applied(body, objects(), random.Random(0)).request
    assert (changed.model, changed.objective, changed.priority) == ("base-v2", "premium", 10)
