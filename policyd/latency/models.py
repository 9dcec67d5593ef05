"""Every pod's TTFT and TPOT model, learned from policyd's own outcomes, read lock-free.

Per pod: one ``Learner`` for TTFT over the uncached prompt tokens and the
pod's load when policyd routed to it (the prefill policyd had queued there
among it), one for TPOT over its batch and the
request's context. A pod's models start again when it is no longer the pod
they learned: another address (a restarted pod gets a new one) or another
served model.

Only the event loop learns (``learn``), once per finished exchange; each
lesson publishes a new mapping of fits (never changed once published), which decisions read by
one reference (``fits``), so a read takes no lock and sees one consistent
state. ``predict_ttft`` and ``predict_tpot`` answer ``COLD`` (-1.0) for a pod without enough
outcomes yet, which CEL reads as "no prediction" (docs/policy-language.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple, Protocol

from policyd.latency.model import WARM, Fit, Learner

COLD: Final = -1.0  # the predicted_* fields' value while a pod has no prediction yet
MAX_PODS: Final = 10_000  # pods with models; past it, the longest known is forgotten
MAX_CACHED: Final = 4096  # pods whose folded terms are kept; past it, start again
# A linear fit may extrapolate below zero at loads it has not seen: a prediction
# is never below a tenth of a millisecond.
FLOOR_MS: Final = 0.1
TTFT_WIDTH: Final = 7
TPOT_WIDTH: Final = 5


class LoadLike(Protocol):
    """The pod fields the models read (``policyd.policy.pods.PolicyPod`` has them all)."""

    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def base_model(self) -> str: ...
    @property
    def waiting_queue(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def kv_cache(self) -> float: ...


class Loaded(LoadLike, Protocol):
    """A pod with policyd's live in-flight count and queued prefill (``Pod``, ``PolicyPod``)."""

    @property
    def in_flight(self) -> int: ...
    @property
    def queued_prefill_tokens(self) -> int: ...


def uncached_prompt(prompt_tokens: int, prefix_match: float | None) -> int:
    """The prompt tokens a pod has to prefill, by the request's estimate and its prefix match
    there: what the serving path queues on the chosen pod, and learns from when the answer
    does not say."""
    return max(round(prompt_tokens * (1.0 - (prefix_match or 0.0))), 0)


def ttft_features(
    uncached_tokens: int, pod: LoadLike, in_flight: int, queued_prefill: int
) -> tuple[float, float, float, float, float, float, float]:
    """TTFT's features: the prefill to do and the prefill policyd queued ahead of it (in
    thousands of tokens), and the rest of what is ahead of it.

    The queued prefill is what a short request waits behind on a pod doing a long
    one, which no scraped figure counts in tokens.
    """
    return (
        1.0,
        uncached_tokens / 1000.0,
        float(pod.waiting_queue),
        float(pod.running),
        pod.kv_cache,
        float(in_flight),
        queued_prefill / 1000.0,
    )


def tpot_features(
    context_tokens: int, pod: LoadLike, in_flight: int
) -> tuple[float, float, float, float, float]:
    """TPOT's features: the batch it decodes in and the context it attends to."""
    return (
        1.0,
        float(pod.running),
        float(in_flight),
        pod.kv_cache,
        context_tokens / 1000.0,
    )


class Identity(NamedTuple):
    """What makes a pod the same pod to its models."""

    address: str
    base_model: str


def identity(pod: LoadLike) -> Identity:
    return Identity(pod.address, pod.base_model)


@dataclass(frozen=True, slots=True)
class PodFits:
    """One pod's published fits and the identity they were learned on."""

    identity: Identity
    ttft: Fit
    tpot: Fit


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished exchange as the models learn from it.

    ``pod`` is the pod as the decision saw it (its scraped load then),
    ``in_flight`` policyd's count there before this request and
    ``queued_prefill`` the prefill tokens policyd had queued there; ``tpot_ms`` is
    None for an answer of one token or less (nothing to time between tokens).
    """

    pod: LoadLike
    in_flight: int
    queued_prefill: int
    uncached_tokens: int
    context_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None


class _PodLearners:
    __slots__ = ("identity", "tpot", "ttft")

    def __init__(self, who: Identity) -> None:
        self.identity = who
        self.ttft = Learner(TTFT_WIDTH)
        self.tpot = Learner(TPOT_WIDTH)


# One snapshot pod's predictions with its scraped load folded in (``_fold``): what
# varies per request (uncached tokens, context, in-flight count, queued prefill) is left
# as a coefficient each. TTFT's: the base, per uncached token, per request in flight, per
# queued prefill token; TPOT's: the base, per context token, per request in flight.
_TtftTerms = tuple[float, float, float, float]
_TpotTerms = tuple[float, float, float]
# A cache entry, one per pod name: the snapshot's pod object whose load it folded, the
# fits that made it, then TTFT's and TPOT's terms (None: that model is cold). Plain
# tuples, not named ones: CPython's fast paths for indexing and unpacking take exact
# tuples only, and a decision reads one per candidate.
_Terms = tuple[object, PodFits | None, _TtftTerms | None, _TpotTerms | None]


class LatencyModels:
    """The pods' models; ``learn`` on the event loop, ``predict_ttft`` / ``predict_tpot``
    anywhere."""

    def __init__(self) -> None:
        self._learners: dict[str, _PodLearners] = {}
        self.fits: Mapping[str, PodFits] = {}
        # Read and written by decisions (any thread): each entry says what made it, and
        # a stale or lost one is made again.
        self._cache: dict[str, _Terms] = {}

    def learn(self, outcome: Outcome) -> None:
        pod = outcome.pod
        who = identity(pod)
        learners = self._learners.get(pod.name)
        if learners is None or who != learners.identity:
            if learners is None and len(self._learners) >= MAX_PODS:
                self.forget({next(iter(self._learners))})  # the longest known: pods churn
            learners = self._learners[pod.name] = _PodLearners(who)
        if outcome.ttft_ms is not None:
            learners.ttft.learn(
                ttft_features(
                    outcome.uncached_tokens, pod, outcome.in_flight, outcome.queued_prefill
                ),
                outcome.ttft_ms,
            )
        if outcome.tpot_ms is not None:
            learners.tpot.learn(
                tpot_features(outcome.context_tokens, pod, outcome.in_flight), outcome.tpot_ms
            )
        fits = dict(self.fits)
        fits[pod.name] = PodFits(who, learners.ttft.fit, learners.tpot.fit)
        self.fits = fits

    def forget(self, names: set[str]) -> None:
        """Drop the models of pods that left the pool."""
        gone = names & self._learners.keys()
        if not gone:
            return
        for name in gone:
            del self._learners[name]
        self.fits = {k: v for k, v in self.fits.items() if k not in gone}

    def predict_ttft(self, pods: Sequence[Loaded], uncached_tokens: Sequence[int]) -> list[float]:
        """Each pod's predicted TTFT in milliseconds (``COLD`` where it has none yet), at
        its own in-flight count, queued prefill and uncached prompt tokens.

        A decision that reads predictions makes one per candidate: the part of
        each prediction that depends on the pod's scraped load alone is kept per
        pod for its snapshot object and fit, so a decision pays three multiplications
        each.
        """
        cache = self._cache
        fits = self.fits
        out = []
        for pod, uncached in zip(pods, uncached_tokens, strict=True):
            name = pod.name
            terms = cache.get(name)
            if terms is None or terms[0] is not pod or terms[1] is not fits.get(name):
                terms = self._terms_of(pod)
            folded = terms[2]
            if folded is None:
                out.append(COLD)
                continue
            # Unpacked and written out: a method call per value costs more than the sums.
            base, per_uncached, per_in_flight, per_queued = folded
            ttft = (
                base
                + per_uncached * uncached
                + per_in_flight * pod.in_flight
                + per_queued * pod.queued_prefill_tokens
            )
            if ttft < FLOOR_MS:  # noqa: PLR1730 - max() costs a call per pod
                ttft = FLOOR_MS
            out.append(ttft)
        return out

    def predict_tpot(self, pods: Sequence[Loaded], context_tokens: int) -> list[float]:
        """Each pod's predicted TPOT in milliseconds (``COLD`` where it has none yet), at
        its own in-flight count, for a request of ``context_tokens``.

        Asked apart from TTFT: a policy that does not read TPOT needs it for the
        chosen pod alone (the decision carries its prediction), not per candidate.
        """
        cache = self._cache
        fits = self.fits
        out = []
        for pod in pods:
            name = pod.name
            terms = cache.get(name)
            if terms is None or terms[0] is not pod or terms[1] is not fits.get(name):
                terms = self._terms_of(pod)
            folded = terms[3]
            if folded is None:
                out.append(COLD)
                continue
            base, per_context, per_in_flight = folded
            tpot = base + per_context * context_tokens + per_in_flight * pod.in_flight
            if tpot < FLOOR_MS:  # noqa: PLR1730 - max() costs a call per pod
                tpot = FLOOR_MS
            out.append(tpot)
        return out

    def _terms_of(self, pod: LoadLike) -> _Terms:
        fits = self.fits.get(pod.name)
        if fits is not None and fits.identity != (pod.address, pod.base_model):
            fits = None
        terms = _fold(pod, fits)
        cache = self._cache
        if len(cache) >= MAX_CACHED:
            cache = self._cache = {}
        cache[pod.name] = terms
        return terms


def _fold(pod: LoadLike, fits: PodFits | None) -> _Terms:
    """``pod``'s terms under ``fits``: each warm model's coefficients with the pod's
    scraped load summed into its base."""
    ttft: _TtftTerms | None = None
    tpot: _TpotTerms | None = None
    if fits is not None and fits.ttft.samples >= WARM:
        t0, t1, t2, t3, t4, t5, t6 = fits.ttft.coefficients
        base = t0 + t2 * pod.waiting_queue + t3 * pod.running + t4 * pod.kv_cache
        ttft = (base, t1 / 1000.0, t5, t6 / 1000.0)
    if fits is not None and fits.tpot.samples >= WARM:
        p0, p1, p2, p3, p4 = fits.tpot.coefficients
        tpot = (p0 + p1 * pod.running + p3 * pod.kv_cache, p4 / 1000.0, p2)
    return (pod, fits, ttft, tpot)
