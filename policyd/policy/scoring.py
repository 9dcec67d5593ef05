"""Weighted scorers: ``total = sum(weight * clamp(score, 0, 1))`` per pod.

Each scorer's value is clamped to [0, 1] (a bool counts as 0 or 1, NaN as 0),
so one scorer cannot drown the others however large its raw value; the
weights alone say how much each matters. A scorer that fails on a pod adds
nothing for that pod, and the error is traced.

What a scorer computes per pod is its kind's: each scorer kind is one class in
``policyd.policy.kinds`` (``expr``, ``rendezvous``), registered by the YAML word
that gives a scorer that kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from policyd.policy.evaluation import FAILED, Compiling, Evaluation
from policyd.policy.pods import PolicyPod
from policyd.policy.reader import Expression


class ScoreValues(Protocol):
    """A compiled scorer's expression: its source and its value on each pod."""

    @property
    def source(self) -> str: ...

    def values(
        self, pods: Sequence[PolicyPod], ev: Evaluation
    ) -> tuple[list[Any], list[tuple[str, str]]]:
        """Each pod's raw value (``FAILED`` where it failed), and the errors by pod."""
        ...


@dataclass(frozen=True, slots=True, eq=False)
class ScorerSpec:
    """A scorer as read from the file: name, weight, and its kind's expression."""

    name: str
    weight: float
    kind: ScorerKind
    expression: Expression


class ScorerKind(Protocol):
    """One scorer kind: its class, as ``policyd.policy.kinds`` registers it."""

    @property
    def kind(self) -> str:
        """The YAML word that gives a scorer this kind (``expr: ...``)."""
        ...

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON Schema of that word's value, for ``policy.schema.json``."""
        ...

    def build(self, spec: ScorerSpec, compiler: Compiling) -> ScoreValues | None:
        """What computes the values, or None when the expression did not compile."""
        ...


@dataclass(frozen=True, slots=True)
class Scorer:
    name: str
    weight: float
    expression: ScoreValues


def clamp(value: float) -> float:
    """A raw scorer value in [0, 1]; NaN and negatives count as 0.

    ``score`` applies the same rule inline; a test holds the two together.
    """
    if not value >= 0:
        return 0.0
    return 1.0 if value > 1 else float(value)


def score(
    scorers: Sequence[Scorer], pods: Sequence[PolicyPod], ev: Evaluation
) -> tuple[list[float], list[tuple[str, str]]]:
    """The total score of each pod, and the scorers' errors (named by scorer)."""
    totals = [0.0] * len(pods)
    errors: list[tuple[str, str]] = []
    for scorer in scorers:
        values, failures = scorer.expression.values(pods, ev)
        weight = scorer.weight
        for index, value in enumerate(values):
            # ``clamp`` inlined (NaN fails ``>= 0`` there too): a call per pod and
            # scorer is a visible share of a decision over 100 pods
            # (``benchmarks/decision.py``).
            if value is not FAILED and value >= 0:
                totals[index] += weight if value > 1 else weight * value
        errors.extend((pod, f"{scorer.name}: {message}") for pod, message in failures)
    return totals, errors
