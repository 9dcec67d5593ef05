"""What the router decided for one request, and the trail that explains it.

``NodeTrace`` and ``Decision`` are values: nothing changes them once the router
has returned them. They are not ``frozen`` dataclasses only because a frozen
dataclass's ``__init__`` costs several times more, and the router builds one
``NodeTrace`` per node and one ``Decision`` per request.

A decision under a policy with shadow policies carries ``ShadowInputs``: the
shadow policies and what they decide over (the request and candidates the live
decision saw), plain data. Deciding them is a separate call,
``Router.decide_shadows(decision) -> ShadowReport``, made by whoever holds the
decision once the live reply has gone out (the serving path's exchange, or
``explain``); the report goes to telemetry as data too.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from policyd.policy.pods import PolicyPod
from policyd.policy.request import Request

if TYPE_CHECKING:  # both import this module
    from policyd.policy.compiler import CompiledPolicy
    from policyd.policy.router import PrefixMatcher


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

    ``kind`` is the node kind, the YAML word that made it (``keep``, ``if``,
    ``band``, ``top_k``, ``shed``: ``policyd.policy.kinds``), or "score" for the
    scorers. ``narrows`` says the kind keeps some of its pods (keep, band,
    top_k): only then do ``kept`` and the pods not kept mean anything (metrics
    count them, the demo shows them). ``kept`` names the pods that passed; an
    ``if`` filters nothing and leaves it empty, as do shed and score.
    ``errors`` pairs a pod name with its CEL error (an empty name for an
    ``if``, which runs once per request); whether an erroring pod was kept
    depends on the node's ``on_error``. ``branch`` is the way the walk left the
    node ("on_success", "on_failure", "then", "else"; "" for shed and score)
    and ``next`` the node it went to ("" when the walk ended here). ``note`` is
    a short detail: the ``if``'s value or the shed reason; ``band`` is a band
    node's ``(min, limit)``.
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
    narrows: bool = False


# Why a two-stage policy did or did not split a request (``Split.reason``).
WHEN_TRUE: Final = "when-true"  # `prefill.when` held on the decode pod: split
WHEN_FALSE: Final = "when-false"  # it did not: the decode pod prefills too
WHEN_ERROR: Final = "when-error"  # it failed on the decode pod (the error is the note)
NO_PREFILL_POD: Final = "no-prefill-pod"  # the prefill stage found no pod other than it
SPLIT_REASONS: Final = (WHEN_TRUE, WHEN_FALSE, WHEN_ERROR, NO_PREFILL_POD)


@dataclass(slots=True)
class Split:
    """The second stage of a policy with a ``prefill`` section: a prefill pod, or why not.

    ``split`` says the request goes to the decision's (decode) pod with the
    prefill pod named beside it; ``reason`` is one of ``SPLIT_REASONS``.
    ``endpoint``, ``pod`` and ``chosen`` are the prefill pod's (empty unless
    split); ``trace``, ``survivors`` and ``scores`` are the prefill stage's, as
    a ``Decision``'s are the decode stage's (empty when ``when`` did not hold:
    the prefill stage does not run then). ``note`` says more: the CEL error of
    ``when``, or why the prefill stage found no pod.
    """

    split: bool
    reason: str
    endpoint: str = ""
    pod: str = ""
    chosen: PolicyPod | None = None
    trace: tuple[NodeTrace, ...] = ()
    survivors: tuple[str, ...] = ()
    scores: tuple[tuple[str, float], ...] = ()
    note: str = ""


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
    # The pods the policy chose from (its pool), as the snapshot holds them: for
    # telemetry's record of the inputs. Not a copy: read it soon.
    candidates: Sequence[PolicyPod] = ()
    # What deciding the policy's shadow policies needs (None: it has none).
    shadow_inputs: ShadowInputs | None = None
    # The picked pod object itself (None unless routed), so the server can count
    # the request against it without searching the candidates.
    chosen: PolicyPod | None = None
    # For a policy that reads the prefix fields: the chosen pod's prefix-cache
    # match and the best any candidate offered (None: not computed).
    prefix_match: float | None = None
    best_prefix_match: float | None = None
    # Requests policyd had in flight on the chosen pod as it was chosen (the latency
    # models learn the outcome against the load the decision saw).
    chosen_in_flight: int = 0
    # The prefill queued on it then (``pod.queued_prefill_tokens``), for the same reason.
    chosen_queued_prefill: int = 0
    # For a policy that reads the predicted latencies: the chosen pod's (TTFT ms,
    # TPOT ms), -1.0 where it had none yet (None: not computed).
    predicted: tuple[float, float] | None = None
    # Flow control held the request before this decision (None: it was not held):
    # for how long, and how many requests were held ahead of it when it came.
    held_seconds: float | None = None
    queue_position: int | None = None
    # A policy with a ``prefill`` section, once it routed: the prefill stage's answer
    # (None: a single-stage policy, or the request was not routed).
    split: Split | None = None

    @property
    def candidate_count(self) -> int:
        """How many pods the policy chose from (0 when it never got that far)."""
        if self.trace:
            return self.trace[0].candidates_in
        return len(self.candidates) or len(self.survivors)


class Agreement(enum.Enum):
    """How a shadow policy's decision compares with the live one."""

    SAME_POD = "same-pod"  # both routed, to the same pod
    OTHER_POD = "other-pod"  # both routed, to different pods
    SAME_OUTCOME = "same-outcome"  # neither routed, for the same outcome (e.g. both shed)
    OTHER_OUTCOME = "other-outcome"  # one routed and the other not, or different outcomes

    @property
    def agrees(self) -> bool:
        return self in (Agreement.SAME_POD, Agreement.SAME_OUTCOME)


def agreement(live_outcome: Outcome, live_pod: str, shadow: Decision) -> Agreement:
    if shadow.outcome is not live_outcome:
        return Agreement.OTHER_OUTCOME
    if live_outcome is not Outcome.ROUTED:
        return Agreement.SAME_OUTCOME
    return Agreement.SAME_POD if shadow.pod == live_pod else Agreement.OTHER_POD


@dataclass(frozen=True, slots=True)
class ShadowResult:
    """What one shadow policy would have decided, and how that compares."""

    decision: Decision
    agreement: Agreement


@dataclass(frozen=True, slots=True)
class ShadowInputs:
    """What a live decision's shadow policies decide over, kept until they are decided.

    ``policies`` are the live policy's shadows as compiled when it decided
    (``policyd.policy.compiler.CompiledPolicy``), so a policy swapped in
    meanwhile changes nothing; ``request`` and ``candidates`` are the live
    decision's own. ``picked_in_flight`` is the picked pod's in-flight count
    when the live decision was made: the serving path counts the request
    against that pod before the shadows run, and they must see it as the live
    decision did.
    """

    policies: tuple[CompiledPolicy, ...]
    request: Request
    candidates: Sequence[PolicyPod]
    picked: PolicyPod | None  # the live decision's pod (None unless routed)
    picked_in_flight: int
    prompt: PrefixMatcher | None = None  # the live decision's, for shadows that read it


@dataclass(frozen=True, slots=True)
class ShadowReport:
    """What each shadow policy would have decided, and how long deciding them all took."""

    results: tuple[ShadowResult, ...]
    seconds: float
