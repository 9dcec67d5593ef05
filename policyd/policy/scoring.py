"""Weighted CEL scorers: ``total = sum(weight * clamp(score, 0, 1))`` per pod.

Each scorer's value is clamped to [0, 1] (a bool counts as 0 or 1, NaN as 0),
so one scorer cannot drown the others however large its raw value; the
weights alone say how much each matters. A scorer that fails on a pod adds
nothing for that pod, and the error is traced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from policyd.policy.evaluation import FAILED, Evaluation, PodExpression


@dataclass(frozen=True, slots=True)
class Scorer:
    name: str
    weight: float
    expression: PodExpression


def clamp(value: Any) -> float:
    """A raw scorer value in [0, 1]; NaN and negatives count as 0."""
    if not value >= 0:
        return 0.0
    return 1.0 if value > 1 else float(value)


def score(
    scorers: Sequence[Scorer], pods: Sequence[Any], ev: Evaluation
) -> tuple[list[float], list[tuple[str, str]]]:
    """The total score of each pod, and the scorers' errors (named by scorer)."""
    totals = [0.0] * len(pods)
    errors: list[tuple[str, str]] = []
    for scorer in scorers:
        values, failures = scorer.expression.values(pods, ev)
        weight = scorer.weight
        for index, value in enumerate(values):
            if value is not FAILED:
                totals[index] += weight * clamp(value)
        errors.extend((pod, f"{scorer.name}: {message}") for pod, message in failures)
    return totals, errors
