"""``rendezvous: <string CEL over request and params>``: rendezvous hashing on a key.

Every pod scores a fixed pseudo-random number in [0, 1) for the pair (key, pod
name). Requests with the same key therefore agree on an order of the pods
without any shared state, in every policyd replica and after restarts, and a
pod joining or leaving changes the first choice only for the keys whose first
choice it is (highest-random-weight hashing). Weighted next to load scorers,
it becomes a preferred "home" that load can override.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Final

from policyd.cel import CelEvalError
from policyd.policy.evaluation import FAILED, Compiling, Evaluation, Evaluator
from policyd.policy.scoring import ScorerSpec

_HASH_SPACE: Final = float(1 << 64)
SEES: Final = (
    "a rendezvous key is computed once per request and sees only request and params "
    "(each pod's name is hashed with it)"
)


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
    """The request's key, computed once per decision, hashed with each pod's name."""

    source: str
    key: Evaluator

    kind: ClassVar[str] = "rendezvous"
    schema: ClassVar[dict[str, Any]] = {
        "$ref": "#/$defs/cel",
        "description": "Rendezvous hashing: a string key over request and params; each pod "
        "scores a fixed pseudo-random number in [0, 1) for (key, pod name).",
    }

    @classmethod
    def build(cls, spec: ScorerSpec, compiler: Compiling) -> RendezvousScore | None:
        key = compiler.request_expression(
            spec.expression,
            what=f"the rendezvous key of scorer '{spec.name}'",
            want=("STRING",),
            sees=SEES,
        )
        return cls(spec.expression.source, key) if key is not None else None

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
