"""``rendezvous: <string CEL>``: rendezvous hashing on a key.

Every pod scores a fixed pseudo-random number in [0, 1) for the pair (key, pod
name). Requests with the same key therefore agree on an order of the pods
without any shared state, in every policyd replica and after restarts, and a
pod joining or leaving changes the first choice only for the keys whose first
choice it is (highest-random-weight hashing). Weighted next to load scorers,
it becomes a preferred "home" that load can override.

The key is evaluated per pod, so it may read the pod: an empty key scores 0,
which gives a request no home on that pod. That is how a policy keeps homes
for what needs one (a LoRA adapter, which takes a slot) and not for what
every pod serves alike (the base model, ``pod.base_model``): one home for all
of a base model's requests would draw them to one pod.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Final

from policyd.policy.evaluation import FAILED, Compiling, Evaluation, PodExpression
from policyd.policy.pods import PolicyPod
from policyd.policy.scoring import ScorerSpec

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
    """Each pod's key hashed with its name; an empty key scores 0."""

    source: str
    key: PodExpression

    kind: ClassVar[str] = "rendezvous"
    schema: ClassVar[dict[str, Any]] = {
        "$ref": "#/$defs/cel",
        "description": "Rendezvous hashing: a string key over pod, request and params; each "
        "pod scores a fixed pseudo-random number in [0, 1) for (key, pod name), 0 for an "
        "empty key.",
    }

    @classmethod
    def build(cls, spec: ScorerSpec, compiler: Compiling) -> RendezvousScore | None:
        key = compiler.pod_expression(
            spec.expression, what=f"the rendezvous key of scorer '{spec.name}'", want=("STRING",)
        )
        return cls(spec.expression.source, key) if key is not None else None

    def values(
        self, pods: Sequence[PolicyPod], ev: Evaluation
    ) -> tuple[list[Any], list[tuple[str, str]]]:
        """Each pod's weight for its key (``FAILED`` where the key failed)."""
        keys, errors = self.key.values(pods, ev)
        return [
            FAILED if key is FAILED else rendezvous_weight(key, pod.name) if key else 0.0
            for key, pod in zip(keys, pods, strict=True)
        ], errors
