"""Shadow policies: loaded with the live policy, decided on demand, never acted on."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from importlib import resources
from pathlib import Path

import jsonschema
import pytest

from policyd.policy import PolicyError, PolicyStore, Router
from policyd.policy.commands import run_check
from policyd.policy.decision import Agreement, Decision, Outcome, ShadowResult
from policyd.policy.explain import explain, render_text, to_json
from policyd.policy.loader import load_policy_set

from .helpers import pod, request, write

LIVE = """
name: live
filters:
  short queue:
    keep: pod.waiting_queue < 5
score:
  idle:
    expr: 1.0 - double(pod.waiting_queue) / 10.0
shadows: [candidate.yaml]
"""

# Prefers free KV cache instead of short queues.
CANDIDATE = """
name: candidate
filters:
  short queue:
    keep: pod.waiting_queue < 5
score:
  free kv:
    expr: 1.0 - pod.kv_cache
"""

SHEDDER = """
name: shedder
filters:
  never:
    keep: "false"
"""

PODS = [
    pod("a", waiting_queue=0, kv_cache=0.9),
    pod("b", waiting_queue=3, kv_cache=0.1),
    pod("busy", waiting_queue=9, kv_cache=0.0),
]


def load(tmp_path: Path, live: str, **shadows: str) -> Router:
    for name, text in shadows.items():
        write(tmp_path, text, f"{name}.yaml")
    return Router(load_policy_set(write(tmp_path, live)), rng=random.Random(0))


def problems_of(tmp_path: Path, path: Path) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        load_policy_set(path)
    return [str(d).replace(str(tmp_path) + "/", "") for d in caught.value.diagnostics]


def shadows_of(router: Router, decision: Decision) -> tuple[ShadowResult, ...]:
    report = router.decide_shadows(decision)
    assert report is not None
    return report.results


def test_a_decision_carries_its_shadows_inputs_as_data_and_they_are_decided_when_asked(
    tmp_path: Path,
) -> None:
    router = load(tmp_path, LIVE, candidate=CANDIDATE)
    decision = router.decide(request(), PODS)
    assert (decision.outcome, decision.pod) == (Outcome.ROUTED, "a")  # the live pick
    inputs = decision.shadow_inputs
    assert inputs is not None
    assert [p.name for p in inputs.policies] == ["candidate"]
    assert (inputs.request.model, inputs.candidates, inputs.picked.name) == ("m", PODS, "a")
    assert dataclasses.replace(decision) == decision  # a value: fields only, no callback
    report = router.decide_shadows(decision)
    assert report is not None and report.seconds > 0
    results = report.results
    assert len(results) == 1
    shadow = results[0]
    assert (shadow.decision.policy, shadow.decision.pod) == ("candidate", "b")
    assert shadow.decision.policy_version == router.store.current.policies[0].shadows[0].version
    assert shadow.agreement is Agreement.OTHER_POD and not shadow.agreement.agrees


def test_a_policy_without_shadows_carries_no_shadow_inputs(tmp_path: Path) -> None:
    router = load(tmp_path, CANDIDATE)
    decision = router.decide(request(), PODS)
    assert decision.shadow_inputs is None
    assert router.decide_shadows(decision) is None


def test_agreement_kinds(tmp_path: Path) -> None:
    (tmp_path / "shed").mkdir()
    live_shed = "name: live\nfilters:\n  nothing:\n    keep: 'false'\nshadows: [shedder.yaml]\n"
    both_shed = load(tmp_path / "shed", live_shed, shedder=SHEDDER)
    (result,) = shadows_of(both_shed, both_shed.decide(request(), PODS))
    assert result.agreement is Agreement.SAME_OUTCOME and result.agreement.agrees

    (tmp_path / "routed").mkdir()
    live = LIVE.replace("[candidate.yaml]", "[shedder.yaml]")
    routed_vs_shed = load(tmp_path / "routed", live, shedder=SHEDDER)
    (result,) = shadows_of(routed_vs_shed, routed_vs_shed.decide(request(), PODS))
    assert result.decision.outcome is Outcome.SHED
    assert result.agreement is Agreement.OTHER_OUTCOME and not result.agreement.agrees


def test_a_shadow_identical_to_the_live_policy_agrees_although_the_pick_is_counted(
    tmp_path: Path,
) -> None:
    # Least in-flight: the serving path counts the routed request against the
    # picked pod before shadows run; the shadow must see the pod as the live
    # decision did, or it would move to the other pod every time.
    least_in_flight = """
    name: {name}
    score:
      fewest in flight:
        expr: 1.0 / (1.0 + double(pod.in_flight))
    {shadows}
    """
    write(tmp_path, least_in_flight.format(name="twin", shadows=""), "twin.yaml")
    router = load(tmp_path, least_in_flight.format(name="live", shadows="shadows: [twin.yaml]"))
    pods = [pod("a"), pod("b")]
    for _ in range(6):
        decision = router.decide(request(), pods)
        picked = next(p for p in pods if p.name == decision.pod)
        picked.load.count += 1  # what the serving path does when it routes
        (result,) = shadows_of(router, decision)
        assert result.decision.pod == decision.pod
        assert result.agreement is Agreement.SAME_POD
    assert sorted(p.in_flight for p in pods) == [3, 3]  # the live picks alternated


def test_shadows_never_change_the_live_random_sequence(tmp_path: Path) -> None:
    random_pick = "name: {name}\npick: {{strategy: random}}\n{shadows}\n"
    write(tmp_path, random_pick.format(name="other", shadows=""), "other.yaml")
    with_shadow = load(tmp_path, random_pick.format(name="live", shadows="shadows: [other.yaml]"))
    alone_file = write(tmp_path, random_pick.format(name="live", shadows=""), "alone.yaml")
    alone = Router(load_policy_set(alone_file), rng=random.Random(0))
    pods = [pod(str(i)) for i in range(8)]
    picks_with, picks_alone = [], []
    for _ in range(20):
        decision = with_shadow.decide(request(), pods)
        with_shadow.decide_shadows(decision)
        picks_with.append(decision.pod)
        picks_alone.append(alone.decide(request(), pods).pod)
    assert picks_with == picks_alone


def test_a_shadow_that_fails_on_a_request_is_an_error_decision_not_an_exception(
    tmp_path: Path,
) -> None:
    failing = "name: failing\nfilters:\n  zone:\n    keep: pod.labels['zone'] == 'a'\n"
    router = load(tmp_path, LIVE.replace("candidate.yaml", "failing.yaml"), failing=failing)
    (result,) = shadows_of(router, router.decide(request(), PODS))
    # A CEL error on every pod drops them all (on_error: drop): the shadow sheds.
    assert result.decision.outcome is Outcome.SHED
    assert result.agreement is Agreement.OTHER_OUTCOME


# -- loading --------------------------------------------------------------------------


def test_a_missing_shadow_is_reported_where_it_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, LIVE)
    assert problems_of(tmp_path, path) == [
        "policy.yaml:8:11: shadow policy 'candidate.yaml' not found (looked for candidate.yaml)"
    ]


def test_a_broken_shadow_reports_its_own_problems_too(tmp_path: Path) -> None:
    write(tmp_path, CANDIDATE.replace("kv_cache", "kv_cahce"), "candidate.yaml")
    found = problems_of(tmp_path, write(tmp_path, LIVE))
    assert found[0].startswith("candidate.yaml:7:20: undefined field 'kv_cahce'")
    assert found[1] == (
        "policy.yaml:8:11: shadow policy 'candidate.yaml' does not load (its problems follow)"
    )


def test_shadows_do_not_nest_and_need_names_of_their_own(tmp_path: Path) -> None:
    write(tmp_path, CANDIDATE + "shadows: [other.yaml]\n", "candidate.yaml")
    write(tmp_path, SHEDDER, "other.yaml")
    write(tmp_path, SHEDDER.replace("shedder", "live"), "samename.yaml")
    write(tmp_path, SHEDDER, "shedder.yaml")
    live = LIVE.replace(
        "[candidate.yaml]", "[candidate.yaml, samename.yaml, other.yaml, shedder.yaml, policy.yaml]"
    )
    assert problems_of(tmp_path, write(tmp_path, live)) == [
        "candidate.yaml:8:1: policy 'candidate' is a shadow of 'live' (policy.yaml); "
        "a shadow cannot name shadows of its own",
        "policy.yaml:8:27: shadow policy 'samename.yaml' is named 'live' like this policy; "
        "give it a name of its own so traces and metrics tell them apart",
        "policy.yaml:8:54: two shadow policies are named 'shedder'",
        "policy.yaml:8:68: a policy cannot be its own shadow",
    ]


def test_the_shape_of_shadows_is_checked(tmp_path: Path) -> None:
    path = write(tmp_path, LIVE.replace("[candidate.yaml]", "[a.yaml, a.yaml, 3]"))
    assert problems_of(tmp_path, path) == [
        "policy.yaml:8:19: shadow policy 'a.yaml' is listed twice",
        "policy.yaml:8:27: a shadow policy is a file name, not a number",
    ]
    path = write(tmp_path, LIVE.replace("[candidate.yaml]", "candidate.yaml"))
    assert problems_of(tmp_path, path) == [
        "policy.yaml:8:10: 'shadows' must be a list, not a string"
    ]


def test_in_a_policy_set_a_shadow_file_is_not_served(tmp_path: Path) -> None:
    # Both match every model: were the shadow served too, the set would be ambiguous.
    write(tmp_path, LIVE)
    write(tmp_path, CANDIDATE, "candidate.yaml")
    policies = load_policy_set(tmp_path)
    assert [p.name for p in policies.policies] == ["live"]
    assert [s.name for s in policies.policies[0].shadows] == ["candidate"]


def test_policyd_check_lists_the_shadows_and_their_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, CANDIDATE + "params:\n  unused: {type: int, value: 1}\n", "candidate.yaml")
    path = write(tmp_path, LIVE)
    assert run_check(_arguments(path)) == 0
    out = capsys.readouterr().out.replace(str(tmp_path) + "/", "")
    version = load_policy_set(path).policies[0].shadows[0].version
    assert out.splitlines() == [
        "candidate.yaml:9:3: warning: param 'unused' is never used",
        f"policy.yaml: ok: policy 'live' (version {load_policy_set(path).version}), models *, "
        f"1 filter node, 1 scorer, pick max-score, shadows 'candidate' (version {version})",
    ]


def _arguments(path: Path) -> argparse.Namespace:
    return argparse.Namespace(paths=[path], strict=False)


def test_a_changed_shadow_file_is_reloaded(tmp_path: Path) -> None:
    write(tmp_path, CANDIDATE, "candidate.yaml")
    store = PolicyStore.open(write(tmp_path, LIVE))
    router = Router(store, rng=random.Random(0))
    (result,) = shadows_of(router, router.decide(request(), PODS))
    assert result.decision.pod == "b"
    assert store.reload().changed is False
    write(tmp_path, CANDIDATE.replace("1.0 - pod.kv_cache", "pod.kv_cache"), "candidate.yaml")
    reload = store.reload()
    assert reload.changed and reload.error is None
    (result,) = shadows_of(router, router.decide(request(), PODS))
    assert result.decision.pod == "a"


def test_a_new_shadow_file_named_by_a_reload_is_watched_from_then_on(tmp_path: Path) -> None:
    write(tmp_path, CANDIDATE, "candidate.yaml")
    path = write(tmp_path, LIVE.replace("shadows: [candidate.yaml]\n", ""))
    store = PolicyStore.open(path)
    write(tmp_path, LIVE, "policy.yaml")
    assert store.reload().changed
    assert [s.name for s in store.current.policies[0].shadows] == ["candidate"]
    write(tmp_path, CANDIDATE.replace("1.0 - pod.kv_cache", "pod.kv_cache"), "candidate.yaml")
    assert store.reload().changed


def test_the_json_schema_accepts_shadows(tmp_path: Path) -> None:
    text = resources.files("policyd.policy").joinpath("policy.schema.json").read_text()
    validator = jsonschema.Draft202012Validator(json.loads(text))
    validator.validate({"name": "live", "shadows": ["a.yaml", "b.yaml"]})
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"name": "live", "shadows": "a.yaml"})
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"name": "live", "shadows": ["a.yaml", "a.yaml"]})


def test_explain_shows_what_each_shadow_would_pick(tmp_path: Path) -> None:
    write(tmp_path, CANDIDATE, "candidate.yaml")
    policies = load_policy_set(write(tmp_path, LIVE))
    explanation = explain(policies, request(), PODS)
    version = policies.policies[0].shadows[0].version
    assert render_text(explanation).splitlines()[-1] == (
        f"shadow    candidate (version {version}) would pick b ({PODS[1].address}): "
        "disagrees (other-pod)"
    )
    assert to_json(explanation)["shadows"] == [
        {
            "policy": "candidate",
            "policy_version": version,
            "outcome": "routed",
            "pod": "b",
            "endpoint": PODS[1].address,
            "reason": "",
            "agreement": "other-pod",
        }
    ]


def test_a_policy_set_where_every_file_is_a_shadow_serves_nothing_and_says_so(
    tmp_path: Path,
) -> None:
    write(tmp_path, "name: a\nshadows: [b.yaml]\n", "a.yaml")
    write(tmp_path, "name: b\nshadows: [a.yaml]\n", "b.yaml")
    assert problems_of(tmp_path, tmp_path) == [
        f"{tmp_path}:1:1: every policy here is named as another's shadow: none would be served"
    ]
