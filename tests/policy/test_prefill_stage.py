"""Two-stage policies (a ``prefill`` section): reading, checking, deciding, explaining.

The decode stage is the policy's own tree, scorers and picker over the
decode-capable pods; ``when`` runs on the decode pod it picked; the prefill
stage picks among the prefill-capable pods, never the decode pod itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from policyd.fields.prefix_match import PrefixMatch
from policyd.policy import Request
from policyd.policy.decision import NO_PREFILL_POD, WHEN_ERROR, WHEN_FALSE, WHEN_TRUE, Outcome
from policyd.policy.explain import explain, render_text, to_json
from policyd.policy.pods import PolicyPod
from policyd.policy.testing import read_policy_tests, run_case
from policyd.pool.inflight import InFlight

from .helpers import pod, policy_set, problems, router, warnings, write

PD = """
name: pd
params:
  split_at: {type: int, value: 1000}
  room: {type: int, value: 5}
score:
  light load: {expr: "1.0 - double(pod.in_flight) / 32.0"}
prefill:
  when: request.prompt_tokens - pod.prefix_tokens >= params.split_at
  filters:
    has room:
      keep: pod.waiting_queue < params.room
  score:
    short queue: {expr: "1.0 - double(pod.waiting_queue) / 10.0"}
"""
LONG = Request(model="m", prompt_tokens=3000)
SHORT = Request(model="m", prompt_tokens=200)


def fleet() -> list[PolicyPod]:
    return [
        pod("decode-busy", role="decode", load=_load(8)),
        pod("decode-idle", role="decode"),
        pod("prefill-busy", role="prefill", waiting_queue=4),
        pod("prefill-idle", role="prefill", waiting_queue=1),
        pod("prefill-full", role="prefill", waiting_queue=9),
        pod("encoder", role="encode"),
    ]


def _load(count: int) -> InFlight:
    return InFlight(count)


def test_a_long_prompt_is_split_to_the_best_prefill_pod_with_room(tmp_path: Path) -> None:
    decision = router(tmp_path, PD).decide(LONG, fleet())
    assert (decision.outcome, decision.pod) == (Outcome.ROUTED, "decode-idle")
    split = decision.split
    assert split is not None
    assert (split.split, split.reason, split.pod) == (True, WHEN_TRUE, "prefill-idle")
    assert split.endpoint == pod("prefill-idle").address
    assert set(split.survivors) == {"prefill-busy", "prefill-idle"}  # not the full one
    assert [step.node for step in split.trace] == ["has room", "score"]
    assert split.scores[0][0] == "prefill-idle"


def test_each_stage_chooses_only_among_its_roles(tmp_path: Path) -> None:
    decision = router(tmp_path, PD).decide(LONG, fleet())
    assert set(decision.survivors) == {"decode-busy", "decode-idle"}  # no prefill, no encoder
    assert decision.split is not None and "encoder" not in decision.split.survivors


def test_a_short_prompt_is_not_split_and_the_prefill_stage_does_not_run(tmp_path: Path) -> None:
    split = router(tmp_path, PD).decide(SHORT, fleet()).split
    assert split is not None
    assert (split.split, split.reason, split.pod, split.trace) == (False, WHEN_FALSE, "", ())


def test_when_reads_the_decode_pods_prefix_match(tmp_path: Path) -> None:
    """The decode pod holds 2,500 of the 3,000 tokens: only 500 are uncached."""

    class Prompt:
        def match(self, model: str, pods: Sequence[PolicyPod]) -> list[PrefixMatch]:
            held = PrefixMatch(0.83, 2500)
            return [held if p.name == "decode-idle" else PrefixMatch() for p in pods]

    split = router(tmp_path, PD).decide(LONG, fleet(), Prompt()).split
    assert split is not None and (split.split, split.reason) == (False, WHEN_FALSE)


def test_no_prefill_pod_with_room_means_no_split(tmp_path: Path) -> None:
    pods = [pod("decode-idle", role="decode"), pod("prefill-full", role="prefill", waiting_queue=9)]
    decision = router(tmp_path, PD).decide(LONG, pods)
    assert decision.outcome is Outcome.ROUTED and decision.pod == "decode-idle"
    split = decision.split
    assert split is not None and (split.split, split.reason) == (False, NO_PREFILL_POD)
    assert "has room" in split.note


def test_no_prefill_capable_pod_at_all_means_no_split(tmp_path: Path) -> None:
    split = router(tmp_path, PD).decide(LONG, [pod("decode-idle", role="decode")]).split
    assert split is not None and (split.split, split.reason) == (False, NO_PREFILL_POD)
    assert "of role both or prefill" in split.note


def test_a_pod_of_both_roles_is_never_its_own_prefill_pod(tmp_path: Path) -> None:
    decider = router(tmp_path, PD)
    alone = decider.decide(LONG, [pod("both-a")]).split
    assert alone is not None and (alone.split, alone.reason) == (False, NO_PREFILL_POD)
    assert "decode pod" in alone.note
    pair = decider.decide(LONG, [pod("both-a"), pod("both-b", load=_load(3))])
    assert pair.pod == "both-a"
    assert pair.split is not None and pair.split.pod == "both-b"


def test_without_a_decode_capable_pod_there_is_no_capacity(tmp_path: Path) -> None:
    decision = router(tmp_path, PD).decide(LONG, [pod("prefill-idle", role="prefill")])
    assert decision.outcome is Outcome.NO_CAPACITY
    assert decision.split is None
    assert "of role both or decode" in decision.reason


def test_a_single_stage_policy_routes_to_every_role_and_decides_no_split(tmp_path: Path) -> None:
    single = 'name: one\nscore:\n  light load: {expr: "1.0 - double(pod.in_flight) / 32.0"}\n'
    decision = router(tmp_path, single).decide(LONG, [pod("prefill-idle", role="prefill")])
    assert (decision.pod, decision.split) == ("prefill-idle", None)


def test_an_error_in_when_is_no_split_and_says_why(tmp_path: Path) -> None:
    failing = PD.replace(
        "when: request.prompt_tokens - pod.prefix_tokens >= params.split_at",
        'when: int(request.headers["x-split-at"]) < request.prompt_tokens',
    )
    split = router(tmp_path, failing).decide(LONG, fleet()).split
    assert split is not None and (split.split, split.reason) == (False, WHEN_ERROR)
    assert 'request.headers["x-split-at"]' in split.note or "no such key" in split.note


def test_check_reads_the_second_stage(tmp_path: Path) -> None:
    (policy,) = policy_set(tmp_path, PD).policies
    assert policy.summary.endswith("prefill stage of 1 filter node, 1 scorer, pick max-score")
    assert policy.reads_prefix  # `when` reads pod.prefix_tokens: the router matches prompts


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        ("prefill:\n  filters: {}\n", "'prefill' needs 'when'"),
        ("prefill:\n  when: request.prompt_tokens\n", "must be bool, but this expression is int"),
        ("prefill:\n  when: pod.waiting_queu > 1\n", "undefined field 'waiting_queu'"),
        ("prefill:\n  when: 'true'\n  pick: {fallbacks: 1}\n", "unknown field 'fallbacks'"),
        ("prefill:\n  when: 'true'\n  filter: {}\n", "did you mean 'filters'"),
        (
            "prefill:\n  when: 'true'\n  filters:\n    a: {keep: 'true', next: b}\n",
            "unknown node 'b' in 'next'",
        ),
        ("prefill:\n  when: 'true'\n  score:\n    s: {expr: pod.name}\n", "must be int or"),
        ("prefill: [a]\n", "'prefill' must be a mapping"),
    ],
)
def test_a_bad_second_stage_is_refused_at_its_place(
    tmp_path: Path, section: str, problem: str
) -> None:
    found = problems(tmp_path, "name: p\n" + section)
    assert any(problem in line for line in found), found
    assert all(line.startswith("policy.yaml:") for line in found)


def test_the_second_stage_is_checked_for_unreachable_nodes(tmp_path: Path) -> None:
    text = (
        "name: p\nprefill:\n  when: 'true'\n  filters:\n"
        "    a: {keep: 'true'}\n    b: {keep: 'true'}\n"
    )
    assert any("node 'b' is never reached from 'a'" in line for line in warnings(tmp_path, text))


def test_explain_shows_both_picks_and_the_split(tmp_path: Path) -> None:
    explained = explain(policy_set(tmp_path, PD), LONG, fleet())
    text = render_text(explained)
    assert "decode stage: the pods of role both or decode" in text
    assert "pick      decode-idle" in text
    assert "split     when: request.prompt_tokens - pod.prefix_tokens >= params.split_at" in text
    assert "   decode-idle  true" in text
    assert "prefill stage: the pods of role both or prefill (3), without the decode pod" in text
    assert "   prefill-full  false" in text
    assert "prefill   prefill-idle (" in text and "split (when-true)" in text
    document = to_json(explained)
    json.dumps(document)
    assert document["split"]["split"] is True and document["split"]["pod"] == "prefill-idle"
    assert document["split"]["nodes"][0]["values"]["prefill-full"] == "false"
    short = render_text(explain(policy_set(tmp_path, PD), SHORT, fleet()))
    assert "prefill   none: not split (when-false)" in short
    assert "prefill stage:" not in short


def test_policy_tests_assert_the_split(tmp_path: Path) -> None:
    write(tmp_path, PD, "pd.yaml")
    tests = write(
        tmp_path,
        """
        pods:
          d: {role: decode}
          p: {role: prefill}
        cases:
          split:
            request: {model: m, prompt_tokens: 3000}
            expect: {pick: d, prefill: p, split_reason: when-true}
          wrongly expected a split:
            request: {model: m, prompt_tokens: 10}
            expect: {split: true}
          wrong prefill pod:
            request: {model: m, prompt_tokens: 3000}
            expect: {prefill: d}
          wrong reason:
            request: {model: m, prompt_tokens: 10}
            expect: {split: false, split_reason: no-prefill-pod}
        """,
        "pd.test.yaml",
    )
    loaded = read_policy_tests(tests)
    results = {
        case.name: run_case(policy_set(tmp_path, PD, "pd.yaml"), case) for case in loaded.cases
    }
    assert results["split"].passed
    assert results["wrongly expected a split"].failures == (
        "expected a split, got not split (when-false)",
    )
    assert results["wrong prefill pod"].failures == ("expected prefill pod d, got p",)
    assert results["wrong reason"].failures == (
        "expected split_reason no-prefill-pod, got when-false",
    )


def test_flow_control_holds_a_request_until_a_decode_pod_has_room(tmp_path: Path) -> None:
    """A prefill pod with room is no room for a two-stage policy's request: it would
    find no decode pod (a 503). Prefill pods go along with the decode pods that have
    room, for the prefill stage to judge."""
    flowing = router(tmp_path, PD + "flow:\n  saturated: pod.waiting_queue >= 5\n")
    admission = flowing.admission(LONG)
    assert admission is not None
    busy = [pod("decode-a", role="decode", waiting_queue=9), pod("prefill-a", role="prefill")]
    assert admission.room(busy) == []
    free = [
        pod("decode-a", role="decode", waiting_queue=1),
        pod("decode-b", role="decode", waiting_queue=7),
        pod("prefill-a", role="prefill", waiting_queue=9),
    ]
    assert [p.name for p in admission.room(free)] == ["decode-a", "prefill-a"]
