"""What the router decided for one request, and the trail that explains it.

``NodeTrace`` and ``Decision`` are values: nothing changes them once the router
has returned them. They are not ``frozen`` dataclasses only because a frozen
dataclass's ``__init__`` costs several times more, and the router builds one
``NodeTrace`` per node and one ``Decision`` per request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Outcome(enum.Enum):
    """How a decision ended; each maps to one answer Envoy gets."""

    ROUTED = "routed"  # endpoint chosen: Envoy forwards
    SHED = "shed"  # a shed node, or every candidate filtered out: 429
    NO_CAPACITY = "no-capacity"  # no ready pod at all: 503
    UNKNOWN_MODEL = "unknown-model"  # no policy serves this model: 404
    ERROR = "error"  # a bug or an impossible state: 500

    @property
    def http_status(self) -> int:
        return _STATUS[self]


_STATUS = {
    Outcome.ROUTED: 200,
    Outcome.SHED: 429,
    Outcome.NO_CAPACITY: 503,
    Outcome.UNKNOWN_MODEL: 404,
    Outcome.ERROR: 500,
}


@dataclass(slots=True)
class NodeTrace:
    """One filter-tree node visited (or the scoring step): what went in, what stayed.

    ``kind`` is the node kind ("filter", "condition", "band", "top-k", "shed") or
    "score" for the scorers. ``kept`` names the pods that passed; a condition
    filters nothing and leaves it empty, as do shed and score. ``errors`` pairs a
    pod name with its CEL error (an empty name for a request-level condition);
    whether an erroring pod was kept depends on the node's ``on_error``.
    ``branch`` is the way the walk left the node ("on_success", "on_failure",
    "then", "else"; "" for shed and score) and ``next`` the node it went to
    ("" when the walk ended here). ``note`` is a short detail: the condition's
    value or the shed reason; ``band`` is a band node's ``(min, limit)``.
    """

    node: str
    kind: str
    candidates_in: int
    kept: tuple[str, ...]  # pod names
    errors: tuple[tuple[str, str], ...] = ()  # (pod name, CEL error message)
    branch: str = ""
    next: str = ""
    note: str = ""
    band: tuple[float, float] | None = None


@dataclass(slots=True)
class Decision:
    """The router's answer for one request.

    ``endpoint`` and ``fallbacks`` are ``ip:port`` strings; ``reason`` is a short
    human sentence used in error bodies and spans. ``survivors`` names the pods
    left when the filter tree ended, which the picker chose from; ``scores``
    gives the total score of the best candidates, best first (empty when the
    picker does not use scores).
    """

    outcome: Outcome
    policy: str
    policy_version: str
    target_model: str
    endpoint: str = ""
    pod: str = ""
    fallbacks: tuple[str, ...] = ()
    reason: str = ""
    score: float | None = None
    trace: tuple[NodeTrace, ...] = ()
    scores: tuple[tuple[str, float], ...] = field(default=())  # top candidates, best first
    criticality: str = ""  # as the policy decided it
    survivors: tuple[str, ...] = ()
