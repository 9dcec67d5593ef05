"""Which policy serves a request, the model rewrite / traffic split, criticality, pool."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from policyd.policy import Outcome, PolicyError, Request, Router
from policyd.policy.loader import load_policy_set

from .helpers import pod, request, write

PODS = [pod("a", labels={"pool": "blue"}), pod("b", labels={"pool": "green"})]


def load_set(tmp_path: Path, files: dict[str, str]) -> Router:
    for name, text in files.items():
        write(tmp_path, text, name)
    return Router(load_policy_set(tmp_path), rng=random.Random(0))


def test_the_most_specific_policy_wins(tmp_path: Path) -> None:
    router = load_set(
        tmp_path,
        {
            "catch-all.yaml": "match: {models: ['*']}\n",
            "llama.yaml": "match: {models: [llama, mistral]}\n",
            "llama-canary.yaml": "match: {models: [llama], headers: {x-canary: 'yes'}}\n",
            "any-canary.yaml": "match: {headers: {x-canary: 'yes'}}\n",
        },
    )
    assert router.decide(request("llama"), PODS).policy == "llama"
    assert router.decide(request("mistral"), PODS).policy == "llama"
    assert router.decide(request("llama", {"x-canary": "yes"}), PODS).policy == "llama-canary"
    assert router.decide(request("mistral", {"x-canary": "yes"}), PODS).policy == "llama"
    assert router.decide(request("gemma", {"x-canary": "yes"}), PODS).policy == "any-canary"
    assert router.decide(request("gemma"), PODS).policy == "catch-all"


def test_a_model_no_policy_serves_is_404(tmp_path: Path) -> None:
    router = load_set(tmp_path, {"llama.yaml": "match: {models: [llama]}\n"})
    decision = router.decide(request("gpt-5"), PODS)
    assert decision.outcome is Outcome.UNKNOWN_MODEL
    assert decision.outcome.http_status == 404
    assert decision.reason == "no policy serves model 'gpt-5'"


def test_header_conditions_must_all_hold(tmp_path: Path) -> None:
    router = load_set(
        tmp_path, {"p.yaml": "match: {models: [m], headers: {X-Team: search, x-env: prod}}\n"}
    )
    assert router.decide(request("m", {"x-team": "search"}), PODS).outcome is (
        Outcome.UNKNOWN_MODEL
    )
    both = request("m", {"x-team": "search", "x-env": "prod"})
    assert router.decide(both, PODS).outcome is Outcome.ROUTED


def test_two_policies_matching_the_same_requests_equally_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, "match: {models: [llama, gemma]}\n", "a.yaml")
    write(tmp_path, "match:\n  models: [mistral, llama]\n", "b.yaml")
    write(tmp_path, "match: {models: [llama], headers: {x-a: '1'}}\n", "c.yaml")
    write(tmp_path, "match: {models: [llama], headers: {x-b: '2'}}\n", "d.yaml")
    write(tmp_path, "match: {models: [llama], headers: {x-a: '2'}}\n", "e.yaml")
    with pytest.raises(PolicyError) as error:
        load_policy_set(tmp_path)
    messages = [str(d).replace(str(tmp_path) + "/", "") for d in error.value.diagnostics]
    assert messages == [
        "b.yaml:2:3: policy 'b' and policy 'a' (a.yaml) both match model 'llama' equally "
        "specifically; name the models or add a header condition to tell them apart",
        # c and d could both match a request carrying x-a: 1 and x-b: 2; c and e never can
        "d.yaml:1:8: policy 'd' and policy 'c' (c.yaml) both match model 'llama' with headers "
        "x-a=1, x-b=2 equally specifically; name the models or add a header condition to "
        "tell them apart",
        "e.yaml:1:8: policy 'e' and policy 'd' (d.yaml) both match model 'llama' with headers "
        "x-b=2, x-a=2 equally specifically; name the models or add a header condition to "
        "tell them apart",
    ]


def test_policy_names_are_unique_in_a_set(tmp_path: Path) -> None:
    write(tmp_path, "name: shared\nmatch: {models: [a]}\n", "one.yaml")
    write(tmp_path, "name: shared\nmatch: {models: [b]}\n", "two.yaml")
    with pytest.raises(PolicyError) as error:
        load_policy_set(tmp_path)
    (message,) = [str(d).replace(str(tmp_path) + "/", "") for d in error.value.diagnostics]
    assert message == "two.yaml:1:7: policy name 'shared' is also used by one.yaml"


SPLIT = """
match: {models: [tweet-summary, plain]}
models:
  tweet-summary:
    targets:
      tweet-summary-v1: 90
      tweet-summary-v2: 10
      tweet-summary-v0: 0
filters:
  has target:
    keep: request.target_model in pod.active_loras
"""


def test_traffic_split_draws_target_models_by_weight(tmp_path: Path) -> None:
    write(tmp_path, SPLIT)
    router = Router(load_policy_set(tmp_path / "policy.yaml"), rng=random.Random(42))
    pods = [
        pod("v1", active_loras=("tweet-summary-v1",)),
        pod("v2", active_loras=("tweet-summary-v2",)),
    ]
    decisions = [router.decide(request("tweet-summary"), pods) for _ in range(5000)]
    targets = Counter(d.target_model for d in decisions)
    assert set(targets) == {"tweet-summary-v1", "tweet-summary-v2"}  # weight 0 never
    assert targets["tweet-summary-v2"] / 5000 == pytest.approx(0.10, abs=0.015)
    # the filters see the drawn target: each request lands where its target is loaded
    assert all(d.pod == d.target_model.rsplit("-", 1)[1] for d in decisions)


def test_a_model_without_targets_keeps_its_name(tmp_path: Path) -> None:
    write(tmp_path, SPLIT)
    router = Router(load_policy_set(tmp_path / "policy.yaml"))
    decision = router.decide(request("plain"), [pod("x", active_loras=("plain",))])
    assert decision.target_model == "plain"
    assert decision.pod == "x"


def test_the_callers_request_is_not_changed(tmp_path: Path) -> None:
    write(tmp_path, SPLIT)
    router = Router(load_policy_set(tmp_path / "policy.yaml"))
    original = request("tweet-summary")
    router.decide(original, PODS)
    assert (original.target_model, original.criticality) == ("", "standard")


CRITICALITY = """
criticality:
  header: %s
  default: sheddable
models:
  chat:
    criticality: critical
filters:
  show:
    if: request.criticality == "critical"
"""


@pytest.mark.parametrize(
    ("header_setting", "model", "header_value", "expected"),
    [
        ("x-gateway-inference-criticality", "chat", None, "critical"),  # the model's own
        ("x-gateway-inference-criticality", "batch", None, "sheddable"),  # policy default
        ("x-gateway-inference-criticality", "batch", "Critical", "critical"),  # header wins
        ("x-gateway-inference-criticality", "chat", "standard", "standard"),
        ("x-gateway-inference-criticality", "chat", "bogus", "critical"),  # invalid: ignored
        ("x-priority", "batch", "critical", "critical"),  # another header name
        ("null", "batch", "critical", "sheddable"),  # clients cannot choose
    ],
)
def test_criticality_comes_from_header_then_model_then_default(
    tmp_path: Path, header_setting: str, model: str, header_value: str | None, expected: str
) -> None:
    write(tmp_path, CRITICALITY % header_setting)
    router = Router(load_policy_set(tmp_path / "policy.yaml"))
    name = "x-priority" if header_setting == "x-priority" else "x-gateway-inference-criticality"
    headers = {name: header_value} if header_value else {}
    decision = router.decide(request(model, headers), PODS)
    assert decision.criticality == expected
    assert decision.trace[0].note == str(expected == "critical").lower()


@pytest.mark.parametrize(
    ("priority", "model", "header_value", "expected"),
    [
        (1, "batch", "sheddable", "critical"),  # above 0: over the header and the default
        (0, "chat", "critical", "standard"),  # 0: over the model's own
        (-5, "chat", None, "sheddable"),  # below 0: shed first, as the extension sheds
    ],
)
def test_an_inference_objectives_priority_comes_before_every_other_source(
    tmp_path: Path, priority: int, model: str, header_value: str | None, expected: str
) -> None:
    write(tmp_path, CRITICALITY % "x-gateway-inference-criticality")
    router = Router(load_policy_set(tmp_path / "policy.yaml"))
    headers = {"x-gateway-inference-criticality": header_value} if header_value else {}
    named = Request(model, headers=headers, objective="tier", priority=priority)
    assert router.decide(named, PODS).criticality == expected
    # Without an objective policyd follows, the priority field alone decides nothing.
    unnamed = Request(model, headers=headers, priority=priority)
    assert (
        router.decide(unnamed, PODS).criticality
        == router.decide(request(model, headers), PODS).criticality
    )


def test_pool_labels_limit_the_candidates(tmp_path: Path) -> None:
    write(tmp_path, "pool: {labels: {pool: blue}}\n")
    router = Router(load_policy_set(tmp_path / "policy.yaml"))
    assert {router.decide(request(), PODS).pod for _ in range(20)} == {"a"}
    decision = router.decide(request(), PODS[1:])
    assert decision.outcome is Outcome.NO_CAPACITY
    assert decision.reason == "no ready pods in the policy's pool"


def test_a_bug_costs_one_request_a_500_not_the_caller(tmp_path: Path) -> None:
    class Unlabelled:  # a candidate without the pod's `labels`: an impossible state
        name, address = "x", "10.0.0.9:8000"

    write(tmp_path, "pool: {labels: {pool: blue}}\n")
    router = Router(load_policy_set(tmp_path / "policy.yaml"))
    decision = router.decide(request(), [Unlabelled()])
    assert decision.outcome is Outcome.ERROR
    assert decision.outcome.http_status == 500
    assert decision.reason.startswith("internal error: AttributeError")
