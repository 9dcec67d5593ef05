"""Policy unit tests (``policyd test``): pods + request -> expected decision.

A test file sits next to its policy (``default.yaml`` -> ``default.test.yaml``)
and lists named cases. Each case runs through the real ``Router`` with a seeded
random generator, so a case is deterministic even under a random picker or a
weighted traffic split. See docs/policy-language.md for the format.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from policyd.policy.decision import SPLIT_REASONS, Decision, Outcome
from policyd.policy.diagnostics import Diagnostic, PolicyError
from policyd.policy.explain import would_hold
from policyd.policy.inputs import StaticPod, read_pods, read_request
from policyd.policy.loader import TEST_SUFFIXES, load_policy_set, read_source
from policyd.policy.policyset import PolicySet
from policyd.policy.reader import Fields
from policyd.policy.request import Request
from policyd.policy.router import Router
from policyd.policy.source import YMapping, YNode, YScalar, YSequence, kind_name, parse_yaml

# ``held``: the policy's flow control would hold the request (every pod saturated).
_OUTCOMES: Final = (*(outcome.value for outcome in Outcome), "held")
_EXPECT_FIELDS: Final = (
    "outcome",
    "pick",
    "picks",
    "survivors",
    "fallbacks",
    "target_model",
    "criticality",
    "reason",
    "path",
    "split",
    "split_reason",
    "prefill",
)


@dataclass(frozen=True, slots=True)
class Expectation:
    outcome: str | None = None
    pick: tuple[str, ...] | None = None  # any one of these
    picks: tuple[str, ...] | None = None  # one decision per entry, in order
    survivors: tuple[str, ...] | None = None  # compared as a set
    fallbacks: tuple[str, ...] | None = None
    target_model: str | None = None
    criticality: str | None = None
    reason: str | None = None  # a substring of the decision's reason
    path: tuple[str, ...] | None = None  # the nodes visited, in order
    # A policy with a ``prefill`` section: whether the request is split, why, and
    # the prefill pod (any one of these; implies split).
    split: bool | None = None
    split_reason: str | None = None
    prefill: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    at: tuple[int, int]
    request: Request
    pods: tuple[StaticPod, ...]
    seed: int
    expect: Expectation


@dataclass(frozen=True, slots=True)
class PolicyTests:
    path: str
    policy: Path
    cases: tuple[Case, ...]


@dataclass(frozen=True, slots=True)
class CaseResult:
    case: Case
    failures: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.failures


def policy_tests_path(policy: Path) -> Path:
    """Where the tests of a policy file live."""
    return policy.with_name(policy.name.rsplit(".", 1)[0] + TEST_SUFFIXES[0])


def read_policy_tests(path: Path) -> PolicyTests:
    """Parse a test file or raise ``PolicyError`` with every problem."""
    source = read_source(path)
    root, diagnostics = parse_yaml(source)
    if root is None and diagnostics:
        raise PolicyError(diagnostics)
    if root is None or not isinstance(root, YMapping):
        found = "an empty file" if root is None else kind_name(root)
        at = root.at if root is not None else (1, 1)
        raise PolicyError(
            [*diagnostics, source.diagnostic(at, f"a test file must be a mapping, not {found}")]
        )
    fields = Fields(root, ("policy", "pods", "cases"), diagnostics, what="a test file")
    policy_node = fields.string("policy")
    default_policy = path.name.removesuffix(".test.yaml").removesuffix(".test.yml") + ".yaml"
    policy = path.parent / (str(policy_node.value) if policy_node else default_policy)
    shared_node = fields.raw("pods")
    shared = read_pods(shared_node, diagnostics) if shared_node is not None else ()
    cases_node = fields.mapping("cases")
    cases: list[Case] = []
    if cases_node is None:
        fields.error(root, "a test file needs 'cases'")
    else:
        for name, (key, value) in cases_node.entries.items():
            case = _read_case(
                name,
                key,
                value,
                shared=shared,
                has_shared=shared_node is not None,
                diagnostics=diagnostics,
            )
            if case is not None:
                cases.append(case)
    if any(d.severity == "error" for d in diagnostics):
        raise PolicyError(diagnostics)
    return PolicyTests(str(path), policy, tuple(cases))


def _read_case(
    name: str,
    key: YScalar,
    node: YNode,
    *,
    shared: tuple[StaticPod, ...],
    has_shared: bool,
    diagnostics: list[Diagnostic],
) -> Case | None:
    if not isinstance(node, YMapping):
        diagnostics.append(node.source.diagnostic(node.at, f"case '{name}' must be a mapping"))
        return None
    fields = Fields(node, ("request", "pods", "seed", "expect"), diagnostics, what="a case")
    request_node = fields.raw("request")
    request = read_request(request_node, diagnostics) if request_node is not None else None
    if request_node is None:
        fields.error(key, f"case '{name}' needs a 'request'")
    pods_node = fields.raw("pods")
    pods = read_pods(pods_node, diagnostics) if pods_node is not None else shared
    if pods_node is None and not has_shared:
        fields.error(key, f"case '{name}' has no 'pods' and the file lists none")
    expect_node = fields.mapping("expect")
    if expect_node is None:
        fields.error(key, f"case '{name}' needs an 'expect'")
        return None
    expect = _read_expectation(expect_node, diagnostics)
    seed = fields.integer("seed", minimum=0, default=0) or 0
    if request is None:
        return None
    return Case(name, key.at, request, pods, seed, expect)


def _read_expectation(node: YMapping, diagnostics: list[Diagnostic]) -> Expectation:
    fields = Fields(node, _EXPECT_FIELDS, diagnostics, what="'expect'")
    if not node.entries:
        fields.error(node, "'expect' is empty: say what the decision should be")

    def names(key: str) -> tuple[str, ...] | None:
        value = fields.raw(key)
        if value is None:
            return None
        if isinstance(value, YScalar) and isinstance(value.value, str):
            return (value.value,)
        if isinstance(value, YSequence) and all(
            isinstance(i, YScalar) and isinstance(i.value, str) for i in value.items
        ):
            return tuple(str(i.value) for i in value.items if isinstance(i, YScalar))
        fields.error(value, f"'{key}' must be a name or a list of names")
        return None

    def text(key: str) -> str | None:
        value = fields.string(key)
        return str(value.value) if value else None

    outcome = fields.choice("outcome", _OUTCOMES, "") or None
    split = None
    split_node = fields.raw("split")
    if split_node is not None:
        if isinstance(split_node, YScalar) and isinstance(split_node.value, bool):
            split = split_node.value
        else:
            fields.error(split_node, "'split' must be true or false")
    return Expectation(
        outcome=outcome,
        pick=names("pick"),
        picks=names("picks"),
        survivors=names("survivors"),
        fallbacks=names("fallbacks"),
        target_model=text("target_model"),
        criticality=text("criticality"),
        reason=text("reason"),
        path=names("path"),
        split=split,
        split_reason=fields.choice("split_reason", SPLIT_REASONS, "") or None,
        prefill=names("prefill"),
    )


def run_case(policies: PolicySet, case: Case) -> CaseResult:
    """Decide the case (once, or once per expected pick) and compare."""
    router = Router(policies, rng=random.Random(case.seed))
    expect = case.expect
    decisions = [router.decide(case.request, case.pods) for _ in range(len(expect.picks or "x"))]
    decision = decisions[0]
    names = {pod.address: pod.name for pod in case.pods}
    failures: list[str] = []
    wanted_outcome = expect.outcome or (
        Outcome.ROUTED.value if expect.pick or expect.picks or expect.fallbacks else None
    )
    held = would_hold(router, case.request, case.pods)
    got_outcome = "held" if held else decision.outcome.value
    if wanted_outcome is not None and got_outcome != wanted_outcome:
        failures.append(f"expected outcome {wanted_outcome}, got {held or _describe(decision)}")
    if expect.pick is not None and decision.pod not in expect.pick:
        wanted = expect.pick[0] if len(expect.pick) == 1 else f"one of {list(expect.pick)}"
        failures.append(f"expected pick {wanted}, got {decision.pod or _describe(decision)}")
    if expect.picks is not None:
        got = [d.pod for d in decisions]
        if got != list(expect.picks):
            failures.append(f"expected picks {list(expect.picks)}, got {got}")
    if expect.survivors is not None and set(decision.survivors) != set(expect.survivors):
        failures.append(
            f"expected survivors {sorted(expect.survivors)}, got {sorted(decision.survivors)}"
        )
    if expect.fallbacks is not None:
        got = [names.get(address, address) for address in decision.fallbacks]
        if got != list(expect.fallbacks):
            failures.append(f"expected fallbacks {list(expect.fallbacks)}, got {got}")
    _compare(failures, "target_model", expect.target_model, decision.target_model)
    _compare(failures, "criticality", expect.criticality, decision.criticality)
    if expect.reason is not None and expect.reason not in decision.reason:
        failures.append(f"expected a reason containing '{expect.reason}', got '{decision.reason}'")
    _compare_split(failures, expect, decision)
    if expect.path is not None:
        got = [t.node for t in decision.trace if t.kind != "score"]
        if got != list(expect.path):
            failures.append(f"expected path {list(expect.path)}, got {got}")
    return CaseResult(case, tuple(failures))


def _compare_split(failures: list[str], expect: Expectation, decision: Decision) -> None:
    """The split decision against ``split``, ``split_reason`` and ``prefill``."""
    if expect.split is None and expect.split_reason is None and expect.prefill is None:
        return
    split = decision.split
    if split is None:
        failures.append(f"expected a split decision, got none ({_describe(decision)})")
        return
    wanted = True if expect.prefill is not None else expect.split
    if wanted is not None and split.split != wanted:
        got = f"split to {split.pod}" if split.split else f"not split ({split.reason})"
        failures.append(f"expected {'a split' if wanted else 'no split'}, got {got}")
    _compare(failures, "split_reason", expect.split_reason, split.reason)
    if expect.prefill is not None and split.split and split.pod not in expect.prefill:
        pods = expect.prefill[0] if len(expect.prefill) == 1 else f"one of {list(expect.prefill)}"
        failures.append(f"expected prefill pod {pods}, got {split.pod}")


def _compare(failures: list[str], what: str, wanted: str | None, got: str) -> None:
    if wanted is not None and wanted != got:
        failures.append(f"expected {what} {wanted}, got {got}")


def _describe(decision: Decision) -> str:
    if decision.outcome is Outcome.ROUTED:
        return f"routed to {decision.pod}"
    return f"{decision.outcome.value} ({decision.reason})"


def run_policy_tests(path: Path) -> tuple[PolicyTests, list[CaseResult]]:
    """Load the test file and its policy, run every case; ``PolicyError`` if either is invalid."""
    test_file = read_policy_tests(path)
    policies = load_policy_set(test_file.policy)
    return test_file, [run_case(policies, case) for case in test_file.cases]


def failure_diagnostic(test_file: PolicyTests, result: CaseResult) -> Diagnostic:
    """A failing case as ``file:line:col: FAIL name: reasons``."""
    line, column = result.case.at
    reasons = "; ".join(result.failures)
    return Diagnostic(test_file.path, line, column, f"FAIL {result.case.name}: {reasons}")
