"""Several policies served side by side, and which one a request gets.

A request goes to the *most specific* policy that matches it: a policy that
names the request's model beats one that matches every model; among those, the
one with more header conditions beats the one with fewer. Two policies that
could match the same request equally specifically make the set invalid: the
choice between them would be an accident of file order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from policyd.policy.compiler import CompiledPolicy
from policyd.policy.diagnostics import Diagnostic


@dataclass(frozen=True, slots=True, eq=False)
class PolicySet:
    """Compiled policies, indexed by model; immutable, swapped as a whole."""

    policies: tuple[CompiledPolicy, ...]
    version: str
    by_model: Mapping[str, tuple[CompiledPolicy, ...]]  # most specific first
    any_model: tuple[CompiledPolicy, ...]  # most specific first

    def select(self, model: str, headers: Mapping[str, str]) -> CompiledPolicy | None:
        """The policy serving this request, or None (an unknown model: 404)."""
        for policy in self.by_model.get(model, ()):
            if not policy.headers or _headers_match(policy, headers):
                return policy
        for policy in self.any_model:
            if not policy.headers or _headers_match(policy, headers):
                return policy
        return None

    @property
    def warnings(self) -> tuple[Diagnostic, ...]:
        return tuple(w for policy in self.policies for w in policy.warnings)


def _headers_match(policy: CompiledPolicy, headers: Mapping[str, str]) -> bool:
    return all(headers.get(name) == value for name, value in policy.headers)


def build_policy_set(
    policies: Iterable[CompiledPolicy],
) -> tuple[PolicySet | None, list[Diagnostic]]:
    """The set, or None with the reasons (duplicate names, ambiguous matches)."""
    policies = tuple(policies)
    diagnostics: list[Diagnostic] = []
    seen: dict[str, CompiledPolicy] = {}
    for policy in policies:
        if policy.name in seen:
            diagnostics.append(
                Diagnostic(
                    policy.path,
                    *policy.name_at,
                    f"policy name '{policy.name}' is also used by {seen[policy.name].path}",
                )
            )
        seen.setdefault(policy.name, policy)
    for index, later in enumerate(policies):
        for earlier in policies[:index]:
            overlap = _ambiguity(earlier, later)
            if overlap:
                diagnostics.append(
                    Diagnostic(
                        later.path,
                        *later.match_at,
                        f"policy '{later.name}' and policy '{earlier.name}' ({earlier.path}) "
                        f"both match {overlap} equally specifically; "
                        "name the models or add a header condition to tell them apart",
                    )
                )
    if diagnostics:
        return None, diagnostics
    by_model: dict[str, list[CompiledPolicy]] = {}
    for policy in policies:
        for model in policy.models_matched:
            by_model.setdefault(model, []).append(policy)

    def most_specific_first(group: Iterable[CompiledPolicy]) -> tuple[CompiledPolicy, ...]:
        return tuple(sorted(group, key=lambda p: -len(p.headers)))

    versions = "\n".join(f"{p.path}\t{p.version}" for p in policies)
    version = (
        policies[0].version
        if len(policies) == 1
        else hashlib.sha256(versions.encode()).hexdigest()[:12]
    )
    return (
        PolicySet(
            policies=policies,
            version=version,
            by_model=MappingProxyType({m: most_specific_first(g) for m, g in by_model.items()}),
            any_model=most_specific_first(p for p in policies if not p.models_matched),
        ),
        [],
    )


def _ambiguity(a: CompiledPolicy, b: CompiledPolicy) -> str:
    """What both could match equally specifically ("" if nothing)."""
    if len(a.headers) != len(b.headers):
        return ""
    a_headers, b_headers = dict(a.headers), dict(b.headers)
    if any(b_headers.get(name, value) != value for name, value in a_headers.items()):
        return ""  # a header condition tells them apart
    if not a.models_matched and not b.models_matched:
        models = "every model"
    else:
        shared = sorted(set(a.models_matched) & set(b.models_matched))
        if not shared:
            return ""
        models = "model " + ", ".join(f"'{m}'" for m in shared)
    if a.headers or b.headers:
        conditions = {**a_headers, **b_headers}
        models += " with headers " + ", ".join(f"{k}={v}" for k, v in conditions.items())
    return models
