"""Weighted scorers: ``total = sum(weight * clamp(score, 0, 1))`` per pod.

Each scorer's value is clamped to [0, 1] (a bool counts as 0 or 1, NaN as 0),
so one scorer cannot drown the others however large its raw value; the
weights alone say how much each matters. A scorer that fails on a pod adds
nothing for that pod, and the error is traced.

A scorer is either a CEL expression over the pod (``expr``) or rendezvous
hashing on a key computed from the request (``rendezvous``): every pod scores
a fixed pseudo-random number in [0, 1) for the pair (key, pod name). Requests
with the same key therefore agree on an order of the pods without any shared
state, in every policyd replica and after restarts, and a pod joining or
leaving changes the first choice only for the keys whose first choice it is
(highest-random-weight hashing). Weighted next to load scorers, it becomes a
preferred "home" that load can override.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final

from policyd.cel import CelEvalError
from policyd.policy.evaluation import FAILED, Evaluation, Evaluator, PodExpression

_HASH_SPACE: Final = float(1 << 64)


@lru_cache(maxsize=65536)
def rendezvous_weight(key: str, pod_name: str) -> float:
    """A number in [0, 1) fixed for ``(key, pod_name)``, independent across pod names.

    BLAKE2b rather than ``hash()``: the value must be the same in every process
    (``hash`` of a string is salted per process). Cached, since a policy sees
    few distinct keys and pods and the digest costs more than the lookup.
    """
    digest = hashlib.blake2b(key.encode() + b"\x00" + pod_name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _HASH_SPACE


@dataclass(frozen=True, slots=True)
class RendezvousScore:
    """``rendezvous: <string CEL over request and params>``: the key, once per decision."""

    source: str
    key: Evaluator

    def values(
        self, pods: Sequence[Any], ev: Evaluation
    ) -> tuple[list[Any], list[tuple[str, str]]]:
        """Each pod's weight for the request's key; if the key fails, every pod fails."""
        try:
            key = self.key(ev.activation)
        except CelEvalError as error:
            message = str(error)
            return [FAILED] * len(pods), [(pod.name, message) for pod in pods]
        return [rendezvous_weight(key, pod.name) for pod in pods], []


@dataclass(frozen=True, slots=True)
class Scorer:
    name: str
    weight: float
    expression: PodExpression | RendezvousScore


def clamp(value: float) -> float:
    """A raw scorer value in [0, 1]; NaN and negatives count as 0.

    ``score`` applies the same rule inline; a test holds the two together.
    """
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
            # ``clamp`` inlined (NaN fails ``>= 0`` there too): calling it per pod and
            # scorer cost ~8% of a decision over 100 pods (benchmarks/decision.py).
            if value is not FAILED and value >= 0:
                totals[index] += weight if value > 1 else weight * value
        errors.extend((pod, f"{scorer.name}: {message}") for pod, message in failures)
    return totals, errors
