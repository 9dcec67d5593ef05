"""``Router.decide(request, candidates) -> Decision``: one routing decision.

The router reads the current ``PolicySet`` by one reference at the start of a
decision and uses only that set to the end, so a policy swapped in meanwhile
never mixes with the old one; nothing is locked and nothing blocks. Candidates
are ``PolicyPod``s (``policyd.pool.pod.Pod`` in the service).

Steps: choose the policy (none: 404), resolve criticality and target model,
keep the policy's pool, walk the filter tree (shed or nothing left: 429; no
candidates at all: 503), score the survivors if the picker uses scores, pick.

A policy that reads the prefix fields (``pod.prefix_match``,
``pod.prefix_tokens``) sees each candidate with this request's values laid
over it (``Prefixed``): the caller passes a ``PrefixMatcher`` for the
request's prompt, and the router asks it for one ``PrefixMatch`` per candidate
once per decision, only for such a policy, so a policy that reads neither
pays nothing for them. The decision carries the chosen
pod's match and the best one on offer, to show whether locality won.

So it is with the predicted latencies (``pod.predicted_ttft_ms``,
``pod.predicted_tpot_ms``): for a policy that reads them, the router asks the
``LatencyPredictor`` it was built with (``policyd.latency``) once per decision
for every candidate, from the request's uncached prompt tokens (its prompt
less the prefix match, when there is a prompt to match) and its context, and
lays them over the candidates with the prefix match; the decision carries the
chosen pod's. TPOT is asked per candidate only for a policy that reads it; for
the others, for the chosen pod alone once it is picked.

When the policy has shadow policies, the decision carries ``ShadowInputs``
(plain data: the shadows, the request, the candidates, the pick), and
``decide_shadows(decision)`` decides the same request over the same
candidates under each shadow; the serving path calls it after the live reply
is out. Shadows draw from their own random generator, so they never change the
live policy's random sequence, and they see the picked pod's ``in_flight`` as
the live decision saw it (the serving path has counted the request against
that pod by then).

The walk of the filter tree is reused: the pool publishes candidates as a new
tuple per scrape round, and a tree that reads only pod metrics and a few
request fields (``CompiledPolicy.walk_key``) walks the same way for every
request with the same values of those fields over the same tuple. So the
router keeps the walks of the current tuple, keyed by policy and those
fields, and the hot path pays the tree once per key and snapshot; scoring and
picking, which may read in-flight counts or draw at random, run per request.
"""

from __future__ import annotations

import heapq
import logging
import random
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from policyd.fields.prefix_match import PrefixMatch
from policyd.policy.compiler import CompiledPolicy, CompiledPrefill, WalkKey
from policyd.policy.decision import (
    NO_PREFILL_POD,
    WHEN_ERROR,
    WHEN_FALSE,
    WHEN_TRUE,
    Decision,
    NodeTrace,
    Outcome,
    ShadowInputs,
    ShadowReport,
    ShadowResult,
    Split,
    agreement,
)
from policyd.policy.document import CRITICALITIES
from policyd.policy.evaluation import Evaluation
from policyd.policy.flow import Band, CompiledFlow
from policyd.policy.nodes import Node, pod_names
from policyd.policy.pods import AsSeen, PolicyPod, Prefixed
from policyd.policy.policyset import PolicySet
from policyd.policy.request import Request
from policyd.policy.scoring import score
from policyd.policy.store import PolicyStore

TOP_SCORES: Final = 5  # how many (pod, score) pairs a decision carries
MAX_WALKS: Final = 1024  # walks kept per snapshot; past it the cache starts again
_log = logging.getLogger(__name__)


class PrefixMatcher(Protocol):
    """One request's prompt against the prefix-cache index (``policyd.prefix``)."""

    def match(self, model: str, pods: Sequence[PolicyPod]) -> Sequence[PrefixMatch]:
        """Per pod, in order: its prefix fields for this prompt served as ``model``
        (the target model or adapter)."""
        ...


class LatencyPredictor(Protocol):
    """Each pod's predicted latencies for one request (``policyd.latency.LatencyModels``)."""

    def predict_ttft(
        self, pods: Sequence[PolicyPod], uncached_tokens: Sequence[int]
    ) -> list[float]:
        """Per pod, in order: TTFT ms at its in-flight count and uncached prompt tokens,
        -1.0 where it has no prediction yet."""
        ...

    def predict_tpot(self, pods: Sequence[PolicyPod], context_tokens: int) -> list[float]:
        """Per pod, in order: TPOT ms at its in-flight count for this context, -1.0
        where it has no prediction yet."""
        ...


@dataclass(frozen=True, slots=True)
class _Walk:
    """Where the filter tree led for one request key over one candidate tuple."""

    pods: Sequence[PolicyPod]  # the candidates in the policy's pool
    survivors: Sequence[PolicyPod]
    survivor_names: tuple[str, ...]
    trace: tuple[NodeTrace, ...]
    outcome: Outcome | None  # NO_CAPACITY / SHED when the walk already decided, else None
    reason: str  # why, for those outcomes


@dataclass(frozen=True, slots=True)
class Admission:
    """How the flow control of the policy serving a request treats it (``Router.admission``).

    ``request`` carries the criticality the policy decided; ``policy`` names
    the policy, whose held requests share one queue.
    """

    flow: CompiledFlow
    policy: str
    band: Band
    key: str
    weight: float
    request: Request
    pool_labels: tuple[tuple[str, str], ...]
    roles: frozenset[str] | None = None  # a two-stage policy's decode-capable roles

    def room(self, candidates: Sequence[PolicyPod]) -> list[PolicyPod]:
        """The candidates in the policy's pool that are not saturated for this request.

        For a two-stage policy, a request waits for a decode pod with room; the
        prefill-only pods go with those, for its prefill stage to judge (a split
        request is served on the decode pod whether or not it finds one).
        """
        if self.roles is None:
            return self.flow.room(in_pool(self.pool_labels, candidates), self.request)
        decoders = self.flow.room(in_pool(self.pool_labels, candidates, self.roles), self.request)
        if not decoders:
            return decoders
        pods = in_pool(self.pool_labels, candidates)
        return [*decoders, *(pod for pod in pods if pod.role not in self.roles)]


class _Stage(Protocol):
    """What a walk reads of a stage: a policy's own tree, or its prefill stage's."""

    @property
    def walk_key(self) -> WalkKey | None: ...
    @property
    def start(self) -> Node | None: ...
    @property
    def pool_labels(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def roles(self) -> frozenset[str] | None: ...


# The candidate tuple the walks were made over, and the walks by (stage, key).
_Walks = tuple[Sequence[PolicyPod] | None, dict[tuple[_Stage, Hashable], _Walk]]


class Router:
    """Decides requests against the store's current policy set."""

    def __init__(
        self,
        policies: PolicyStore | PolicySet,
        *,
        rng: random.Random | None = None,
        latency: LatencyPredictor | None = None,
    ) -> None:
        self._store = policies if isinstance(policies, PolicyStore) else PolicyStore(policies)
        self._latency = latency
        self._rng = rng if rng is not None else random.Random()
        self._shadow_rng = random.Random()  # a copy: shadows never draw from the live sequence
        self._shadow_rng.setstate(self._rng.getstate())
        # Replaced whole, never changed in place for another tuple: a decision on
        # another thread holds on to the pair it read.
        self._walks: _Walks = (None, {})

    @property
    def store(self) -> PolicyStore:
        return self._store

    def decide(
        self,
        request: Request,
        candidates: Sequence[PolicyPod],
        prompt: PrefixMatcher | None = None,
    ) -> Decision:
        """Decide ``request`` over ``candidates``; ``prompt`` gives its prefix-cache
        matches to a policy that reads them (without it they read 0)."""
        policy_set = self._store.current  # one read: this decision sees one set
        policy = policy_set.select(request.model, request.headers)
        if policy is None:
            return Decision(
                Outcome.UNKNOWN_MODEL,
                policy="",
                policy_version=policy_set.version,
                target_model=request.model,
                reason=f"no policy serves model '{request.model}'",
            )
        decision, picked = self._decide_safely(policy, request, candidates, self._rng, prompt)
        if policy.shadows:
            seen_in_flight = picked.in_flight if picked is not None else 0
            decision.shadow_inputs = ShadowInputs(
                policy.shadows, request, candidates, picked, seen_in_flight, prompt
            )
        return decision

    def admission(self, request: Request) -> Admission | None:
        """The flow control that applies to ``request`` (None: its policy has none, or no
        policy serves it). Read from the current policy set, so a reload applies to
        a held request the next time it is asked about."""
        policy = self._store.current.select(request.model, request.headers)
        if policy is None or policy.flow is None:
            return None
        flow = policy.flow
        resolved = request.decided(request.model, _criticality(policy, request))
        key = flow.flow_of(resolved)
        return Admission(
            flow,
            policy.name,
            flow.band_of(resolved),
            key,
            flow.weight_of(key),
            resolved,
            policy.pool_labels,
            policy.roles,
        )

    def decide_shadows(self, decision: Decision) -> ShadowReport | None:
        """What each of the live decision's shadow policies would have decided.

        None when its policy has no shadows. Each call decides them anew (the
        serving path calls it once, after the live reply went out); a shadow
        that fails is an error decision, never an exception.
        """
        inputs = decision.shadow_inputs
        if inputs is None:
            return None
        started = time.perf_counter()
        candidates = inputs.candidates
        picked = inputs.picked
        if picked is not None and picked.in_flight != inputs.picked_in_flight:
            # The serving path has counted the live request against the picked pod by
            # now; a shadow identical to the live policy must not see it one busier.
            as_seen = AsSeen(picked, inputs.picked_in_flight)
            candidates = [as_seen if pod is picked else pod for pod in candidates]
        results = []
        for shadow in inputs.policies:
            would = self._decide_safely(
                shadow, inputs.request, candidates, self._shadow_rng, inputs.prompt
            )[0]
            results.append(ShadowResult(would, agreement(decision.outcome, decision.pod, would)))
        return ShadowReport(tuple(results), time.perf_counter() - started)

    def _decide_safely(
        self,
        policy: CompiledPolicy,
        request: Request,
        candidates: Sequence[PolicyPod],
        rng: random.Random,
        prompt: PrefixMatcher | None,
    ) -> tuple[Decision, PolicyPod | None]:
        """The decision and the picked pod (None unless routed)."""
        try:
            return self._decide(policy, request, candidates, rng, prompt)
        except Exception as error:  # a bug must cost one request a 500, not the stream
            _log.exception("routing decision failed under policy %s", policy.name)
            failed = Decision(
                Outcome.ERROR,
                policy=policy.name,
                policy_version=policy.version,
                target_model=request.model,
                reason=f"internal error: {type(error).__name__}: {error}",
            )
            return failed, None

    def _decide(
        self,
        policy: CompiledPolicy,
        request: Request,
        candidates: Sequence[PolicyPod],
        rng: random.Random,
        prompt: PrefixMatcher | None,
    ) -> tuple[Decision, PolicyPod | None]:
        resolved = self._resolve(policy, request, rng)
        best_prefix: float | None = None
        predicts = policy.reads_prediction and self._latency is not None and bool(candidates)
        if candidates and ((policy.reads_prefix and prompt is not None) or predicts):
            matches: Sequence[PrefixMatch] = (
                prompt.match(resolved.target_model, candidates)
                if prompt is not None
                # No prompt to match: the pods' own prefix fields stay as they are.
                else [PrefixMatch(p.prefix_match, p.prefix_tokens) for p in candidates]
            )
            if predicts:
                candidates = self._predicted(policy, resolved, candidates, matches)
            else:
                candidates = [Prefixed(p, m) for p, m in zip(candidates, matches, strict=True)]
            if prompt is not None:
                best_prefix = max(m.prefix_match for m in matches)
        walk, ev = self._walk(policy, resolved, candidates)
        if walk.outcome is not None:
            return self._answer(
                policy,
                resolved,
                walk.outcome,
                reason=walk.reason,
                trace=walk.trace,
                candidates=walk.pods,
            )
        survivors = walk.survivors
        trace = walk.trace
        count = len(survivors)
        totals: list[float] | None = None
        if policy.picker.uses_scores:
            if policy.scorers:
                totals, errors = score(policy.scorers, survivors, ev or Evaluation(resolved))
                trace += (NodeTrace("score", "score", count, (), tuple(errors)),)
            else:
                totals = [0.0] * count
        chosen = policy.picker.pick(totals, count, policy.fallbacks, rng)
        pod = survivors[chosen[0]]
        split = None
        if policy.prefill is not None:
            split = self._split(policy.prefill, resolved, candidates, pod, ev, rng=rng)
        prefix_match: float | None = None
        predicted: tuple[float, float] | None = None
        if isinstance(pod, Prefixed):
            if policy.reads_prefix and prompt is not None:
                prefix_match = pod.prefix_match
            if predicts:
                predicted = (pod.predicted_ttft_ms, self._tpot(policy, resolved, pod))
            pod = pod.pod
        top: tuple[tuple[str, float], ...] = ()
        if totals is not None and policy.scorers:
            best = heapq.nlargest(TOP_SCORES, range(count), key=totals.__getitem__)
            top = tuple((survivors[i].name, totals[i]) for i in best)
        decision = Decision(
            Outcome.ROUTED,
            policy=policy.name,
            policy_version=policy.version,
            target_model=resolved.target_model,
            criticality=resolved.criticality,
            endpoint=pod.address,
            pod=pod.name,
            fallbacks=tuple([survivors[i].address for i in chosen[1:]]) if policy.fallbacks else (),
            score=totals[chosen[0]] if totals is not None and policy.scorers else None,
            survivors=walk.survivor_names,
            trace=trace,
            scores=top,
            candidates=walk.pods,
            chosen=pod,
            prefix_match=prefix_match,
            best_prefix_match=best_prefix,
            chosen_in_flight=pod.in_flight,
            chosen_queued_prefill=pod.queued_prefill_tokens,
            predicted=predicted,
            split=split,
        )
        return decision, pod

    def _split(
        self,
        prefill: CompiledPrefill,
        request: Request,
        candidates: Sequence[PolicyPod],
        decode: PolicyPod,
        ev: Evaluation | None,
        *,
        rng: random.Random,
    ) -> Split:
        """Whether to split the request routed to ``decode``, and to which prefill pod.

        ``when`` sees the decode pod as the decode stage did (with this request's
        prefix match laid over it). The prefill stage runs only when it holds; the
        decode pod is never its own prefill pod, so it leaves the survivors.
        """
        values, errors = prefill.when.values((decode,), ev or Evaluation(request))
        if errors:
            return Split(False, WHEN_ERROR, note=errors[0][1])
        if values[0] is not True:
            return Split(False, WHEN_FALSE)
        walk, walked = self._walk(prefill, request, candidates)
        if walk.outcome is not None:
            return Split(False, NO_PREFILL_POD, trace=walk.trace, note=walk.reason)
        survivors = walk.survivors
        names = walk.survivor_names
        if decode.name in names:
            survivors = [pod for pod in survivors if pod.name != decode.name]
            names = pod_names(survivors)
        trace = walk.trace
        if not survivors:
            note = "the decode pod is the only prefill pod the filters left"
            left = walk.survivor_names
            return Split(False, NO_PREFILL_POD, trace=trace, survivors=left, note=note)
        count = len(survivors)
        totals: list[float] | None = None
        if prefill.picker.uses_scores:
            totals = [0.0] * count
            if prefill.scorers:
                totals, failures = score(prefill.scorers, survivors, walked or Evaluation(request))
                trace += (NodeTrace("score", "score", count, (), tuple(failures)),)
        index = prefill.picker.pick(totals, count, 0, rng)[0]
        pod = survivors[index]
        if isinstance(pod, Prefixed):
            pod = pod.pod
        top: tuple[tuple[str, float], ...] = ()
        if totals is not None and prefill.scorers:
            best = heapq.nlargest(TOP_SCORES, range(count), key=totals.__getitem__)
            top = tuple((survivors[i].name, totals[i]) for i in best)
        return Split(
            True,
            WHEN_TRUE,
            endpoint=pod.address,
            pod=pod.name,
            chosen=pod,
            trace=trace,
            survivors=names,
            scores=top,
        )

    def _predicted(
        self,
        policy: CompiledPolicy,
        request: Request,
        pods: Sequence[PolicyPod],
        matches: Sequence[PrefixMatch],
    ) -> list[PolicyPod]:
        """The candidates with this request's prefix match and predictions laid over them.

        TPOT only for a policy that reads it: the others need the chosen pod's
        alone, which ``_tpot`` asks for once the pod is picked.
        """
        assert self._latency is not None
        prompt_tokens = request.prompt_tokens
        # Written out: max() costs a call per pod (as predict_ttft avoids it).
        uncached = [
            prompt_tokens - m.prefix_tokens if m.prefix_tokens < prompt_tokens else 0
            for m in matches
        ]
        ttfts = self._latency.predict_ttft(pods, uncached)
        if not policy.reads_tpot:
            return [
                Prefixed(pod, match, ttft)
                for pod, match, ttft in zip(pods, matches, ttfts, strict=True)
            ]
        tpots = self._latency.predict_tpot(pods, _context(request))
        return [
            Prefixed(pod, match, ttft, tpot)
            for pod, match, ttft, tpot in zip(pods, matches, ttfts, tpots, strict=True)
        ]

    def _tpot(self, policy: CompiledPolicy, request: Request, chosen: Prefixed) -> float:
        """The chosen pod's predicted TPOT, for the decision: laid over it already when
        the policy reads TPOT, else asked for this pod alone."""
        if policy.reads_tpot:
            return chosen.predicted_tpot_ms
        assert self._latency is not None
        return self._latency.predict_tpot((chosen.pod,), _context(request))[0]

    def _walk(
        self, policy: _Stage, request: Request, candidates: Sequence[PolicyPod]
    ) -> tuple[_Walk, Evaluation | None]:
        """The walk for this request: reused from an earlier request when it may be.

        With it, the evaluation a new walk was made with (its pods' variables
        are the scorers' too), or None for a reused walk: none is made then.
        """
        key_of = policy.walk_key
        if key_of is None or type(candidates) is not tuple:  # a list may change in place
            ev = Evaluation(request)
            return _walk_tree(policy, candidates, ev), ev
        walks = self._walks
        if walks[0] is not candidates or len(walks[1]) >= MAX_WALKS:
            walks = (candidates, {})
            self._walks = walks
        key = (policy, key_of(request))
        walk = walks[1].get(key)
        if walk is not None:
            return walk, None
        ev = Evaluation(request)
        walk = walks[1][key] = _walk_tree(policy, candidates, ev)
        return walk, ev

    @staticmethod
    def _resolve(policy: CompiledPolicy, request: Request, rng: random.Random) -> Request:
        """The request as the policy sees it: criticality and target model decided.

        Criticality: the InferenceObjective's priority, else a valid value of the
        policy's criticality header, else the model's own, else the policy
        default (``_criticality``). The caller's object is not changed.
        """
        rule = policy.models.get(request.model)
        target = rule.target_for(request.model, rng.random) if rule else request.model
        return request.decided(target, _criticality(policy, request))

    @staticmethod
    def _answer(
        policy: CompiledPolicy,
        request: Request,
        outcome: Outcome,
        *,
        reason: str,
        trace: Sequence[NodeTrace] = (),
        candidates: Sequence[PolicyPod] = (),
    ) -> tuple[Decision, None]:
        decision = Decision(
            outcome,
            policy=policy.name,
            policy_version=policy.version,
            target_model=request.target_model,
            criticality=request.criticality,
            reason=reason,
            trace=tuple(trace),
            candidates=candidates,
        )
        return decision, None


def _criticality(policy: CompiledPolicy, request: Request) -> str:
    """The InferenceObjective's, else a valid value of the policy's criticality header,
    else the model's, else the default.

    An objective's integer priority maps onto the three levels as the Gateway API
    Inference Extension's admission does: below 0 is sheddable (shed first when
    the pool is saturated), 0 standard, above 0 critical.
    """
    if request.objective:
        if request.priority > 0:
            return "critical"
        return "standard" if request.priority == 0 else "sheddable"
    if policy.criticality_header:
        asked = request.headers.get(policy.criticality_header, "").strip().lower()
        if asked in CRITICALITIES:
            return asked
    rule = policy.models.get(request.model)
    return (rule.criticality if rule else None) or policy.criticality_default


def _context(request: Request) -> int:
    """The context a request's tokens attend to on average, as TPOT is predicted at:
    its prompt and half its output budget."""
    return request.prompt_tokens + request.max_tokens // 2


def in_pool(
    labels: tuple[tuple[str, str], ...],
    candidates: Sequence[PolicyPod],
    roles: frozenset[str] | None = None,
) -> Sequence[PolicyPod]:
    """The candidates carrying every label of the policy's ``pool`` (and, for a stage
    of a two-stage policy, one of its ``roles``)."""
    if roles is not None:
        candidates = [pod for pod in candidates if pod.role in roles]
    if not labels:
        return candidates
    return [pod for pod in candidates if _has_labels(pod.labels, labels)]


def _has_labels(pod_labels: Mapping[str, str], wanted: tuple[tuple[str, str], ...]) -> bool:
    return all(pod_labels.get(name) == value for name, value in wanted)


def _walk_tree(policy: _Stage, candidates: Sequence[PolicyPod], ev: Evaluation) -> _Walk:
    """Keep the policy's pool, then walk the filter tree from its first node."""
    pods = in_pool(policy.pool_labels, candidates, policy.roles)
    if not pods:
        reason = "no ready pods" if not candidates else "no ready pods in the policy's pool"
        if candidates and policy.roles is not None:
            roles = " or ".join(sorted(policy.roles))
            reason = f"no ready pods of role {roles} in the policy's pool"
        return _Walk(pods, (), (), (), Outcome.NO_CAPACITY, reason)
    trace: list[NodeTrace] = []
    node = policy.start
    survivors: Sequence[PolicyPod] = pods
    while node is not None:
        step, survivors, node, shed = node.visit(survivors, ev)
        trace.append(step)
        if shed:
            return _Walk(pods, (), (), tuple(trace), Outcome.SHED, shed)
    if not survivors:
        last = trace[-1].node if trace else ""
        reason = f"no pod passed the filters (the walk ended at '{last}')"
        return _Walk(pods, (), (), tuple(trace), Outcome.SHED, reason)
    return _Walk(pods, survivors, pod_names(survivors), tuple(trace), None, "")
