"""Prometheus metrics of decisions, shadow policies, responses, streams and reloads.

Every series has bounded labels: ``policy`` and ``node`` come from the loaded
policy files, ``pod`` from the pool (series of pods that left are dropped by
``retain_pods``), the rest are small fixed sets. Recording happens off the
live reply (``RequestRecord.after_reply`` / ``end``) into lock-free tallies, so
a decision costs a few dictionary updates.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Final, Protocol

from prometheus_client import CollectorRegistry, Gauge

from policyd.policy.decision import Decision, NodeTrace, ShadowResult
from policyd.telemetry.identity_cache import IdentityCache
from policyd.telemetry.tally import CounterTally, HistogramTally, Labels, TallyCollector

DECISION_BUCKETS: Final = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
)  # fmt: skip
# Relative prediction errors: 5% .. 5x.
ERROR_BUCKETS: Final = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
RESPONSE_BUCKETS: Final = (
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
# Steps (and walks) whose tally increments are remembered. A walk is reused only
# while the pool's snapshot lasts (one scrape interval when pods report new
# load), so older entries are never hit again, yet each holds its trace and the
# trace's tuples of pod names: thousands of them hold tens of megabytes under
# changing pods.
_STEPS_KEPT: Final = 512

# A step's increments: the tally's values, the label set, the amount.
_StepCounts = tuple[tuple[dict[Labels, float], Labels, int], ...]


class PolicyLike(Protocol):
    """A loaded policy (``policyd.policy.CompiledPolicy``)."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def shadows(self) -> Sequence[PolicyLike]: ...


class PolicySetLike(Protocol):
    @property
    def policies(self) -> Sequence[PolicyLike]: ...


class ReloadLike(Protocol):
    """One reload attempt (``policyd.policy.Reload``)."""

    @property
    def current(self) -> PolicySetLike: ...
    @property
    def error(self) -> object | None: ...


FLOW_WAIT_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
MAX_FLOW_LABELS: Final = 100  # distinct flow names with series of their own; the rest: "other"


class FlowMetrics:
    """Flow control's held requests and what became of them (``policyd.flow``'s observer).

    The flow key comes from requests (a tenant header, say), so only the first
    ``MAX_FLOW_LABELS`` flow names seen get series of their own.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._held = Gauge(
            "policyd_flow_held_requests",
            "Requests flow control holds now, by band and flow.",
            ["band", "flow"],
            registry=registry,
        )
        self._outcomes = CounterTally(
            "policyd_flow_requests",
            "Requests that left flow control's queue, by band, flow and outcome "
            "(dispatched, expired, evicted, refused, abandoned: the client went away, "
            "failed: an error while dispatching it).",
            ["band", "flow", "outcome"],
        )
        self._wait = HistogramTally(
            "policyd_flow_wait_seconds",
            "How long a request was held, by band and outcome.",
            ["band", "outcome"],
            FLOW_WAIT_BUCKETS,
        )
        registry.register(TallyCollector([self._outcomes, self._wait]))
        self._flows: set[str] = set()

    def held(self, band: str, flow: str, change: int) -> None:
        self._held.labels(band, self._label(flow)).inc(change)

    def outcome(self, band: str, flow: str, outcome: str, waited_s: float) -> None:
        self._outcomes.inc((band, self._label(flow), outcome))
        if outcome != "refused":  # a refused request was never held
            self._wait.observe((band, outcome), waited_s)

    def _label(self, flow: str) -> str:
        flows = self._flows
        if flow in flows:
            return flow
        if len(flows) < MAX_FLOW_LABELS:
            flows.add(flow)
            return flow
        return "other"


class DecisionMetrics:
    """The metrics of the serving path, in their own registry.

    The per-request ones are tallies (:mod:`policyd.telemetry.tally`), written
    from the event loop without locks; the reload gauges are
    prometheus-client's own.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._decision_seconds = HistogramTally(
            "policyd_decision_duration_seconds",
            "Time Router.decide took for one request.",
            ["policy"],
            DECISION_BUCKETS,
        )
        self._decisions = CounterTally(
            "policyd_decisions",
            "Routing decisions by policy, outcome and picked pod ('' when not routed).",
            ["policy", "outcome", "pod"],
        )
        self._node_visits = CounterTally(
            "policyd_filter_node_visits",
            "Filter-tree nodes visited, by the branch the walk took.",
            ["policy", "node", "kind", "branch"],
        )
        self._node_pods = CounterTally(
            "policyd_filter_node_pods",
            "Pods that entered a keep, band or top_k node, by whether they were kept.",
            ["policy", "node", "result"],
        )
        self._node_errors = CounterTally(
            "policyd_filter_node_errors",
            "CEL errors while evaluating a node (or the scorers, node 'score') on a pod.",
            ["policy", "node"],
        )
        self._shadows = CounterTally(
            "policyd_shadow_decisions",
            "Shadow-policy decisions by how they compare with the live one "
            "(same-pod, same-outcome agree; other-pod, other-outcome do not).",
            ["policy", "shadow", "agreement"],
        )
        self._shadow_seconds = HistogramTally(
            "policyd_shadow_evaluation_duration_seconds",
            "Time spent deciding one request under all of a policy's shadows.",
            ["policy"],
            DECISION_BUCKETS,
        )
        self._first_token = HistogramTally(
            "policyd_response_time_to_first_token_seconds",
            "From the decision to the first response body bytes.",
            ["policy"],
            RESPONSE_BUCKETS,
        )
        self._response_seconds = HistogramTally(
            "policyd_response_duration_seconds",
            "From the decision to the end of the response.",
            ["policy"],
            RESPONSE_BUCKETS,
        )
        self._responses = CounterTally(
            "policyd_responses",
            "Responses to routed requests by status class (2xx, 4xx, 5xx, aborted).",
            ["policy", "status_class"],
        )
        self._stream_errors = CounterTally(
            "policyd_extproc_stream_errors",
            "ext_proc exchanges that went wrong: rejected before a decision (code: the "
            "error code), internal (code: the phase), aborted (the stream ended first) "
            "or reset (Envoy reset the stream after the exchange ended, code after_end).",
            ["kind", "code"],
        )
        self._prediction_error = HistogramTally(
            "policyd_latency_prediction_error_ratio",
            "|predicted - actual| / actual of the chosen pod's predicted latency (latency"
            " ttft or tpot), for policies that read the predictions; streamed answers.",
            ["policy", "model", "latency"],
            ERROR_BUCKETS,
        )
        self._objectives = CounterTally(
            "policyd_slo_requests",
            "Completed requests that stated a latency objective (ttft or tpot), by whether"
            " the answer met it (true, false).",
            ["policy", "model", "objective", "met"],
        )
        self._reloads = CounterTally(
            "policyd_policy_reloads",
            "Policy reload attempts by result (ok, rejected).",
            ["result"],
        )
        r.register(
            TallyCollector(
                [
                    self._decision_seconds,
                    self._decisions,
                    self._node_visits,
                    self._node_pods,
                    self._node_errors,
                    self._shadows,
                    self._shadow_seconds,
                    self._first_token,
                    self._response_seconds,
                    self._responses,
                    self._stream_errors,
                    self._prediction_error,
                    self._objectives,
                    self._reloads,
                ]
            )
        )
        self._last_reload_ok = Gauge(
            "policyd_policy_last_reload_successful",
            "1 if the last policy reload attempt loaded, 0 if it was rejected.",
            registry=r,
        )
        self._last_reload_time = Gauge(
            "policyd_policy_last_reload_timestamp_seconds",
            "When the serving policy set was last (re)loaded, Unix time.",
            registry=r,
        )
        self._policy_info = Gauge(
            "policyd_policy_info",
            "The policies in force (value 1): name, version (content hash), role live or shadow.",
            ["policy", "version", "role"],
            registry=r,
        )
        self._last_reload_ok.set(1)
        self.flow = FlowMetrics(r)
        # Tally increments per step of a reused walk, and per walk (its trace).
        self._step_counts: IdentityCache[NodeTrace, _StepCounts] = IdentityCache(_STEPS_KEPT)
        self._walk_counts: IdentityCache[tuple[NodeTrace, ...], _StepCounts] = IdentityCache(
            _STEPS_KEPT
        )

    # -- per request ------------------------------------------------------------------

    def decision(self, decision: Decision, seconds: float) -> None:
        policy = decision.policy
        self._decision_seconds.observe((policy,), seconds)
        self._decisions.inc((policy, decision.outcome.value, decision.pod))
        trace = decision.trace
        counts = self._walk_counts.get(trace)
        if counts is None:
            counts = tuple([c for step in trace for c in self._step_counts_of(policy, step)])
            if not trace or trace[-1].kind != "score":  # else made for this request
                self._walk_counts.keep(trace, counts)
        for values, labels, amount in counts:
            values[labels] = values.get(labels, 0) + amount

    def _step_counts_of(self, policy: str, step: NodeTrace) -> _StepCounts:
        """What one step adds to the node tallies, kept for the step's next decisions.

        Requests whose filter-tree walk is reused share its trace and step
        objects, so their increments are worked out once, not per request.
        Scoring steps are made per request and are not kept.
        """
        known = self._step_counts.get(step)
        if known is not None:
            return known
        node, kind = step.node, step.kind
        counts: list[tuple[dict[Labels, float], Labels, int]] = []
        if kind != "score":
            counts.append((self._node_visits.values, (policy, node, kind, step.branch or "end"), 1))
        if step.narrows:  # a node kind that keeps some of its pods
            kept = len(step.kept)
            if kept:
                counts.append((self._node_pods.values, (policy, node, "kept"), kept))
            if step.candidates_in > kept:
                dropped = step.candidates_in - kept
                counts.append((self._node_pods.values, (policy, node, "dropped"), dropped))
        if step.errors:
            counts.append((self._node_errors.values, (policy, node), len(step.errors)))
        result = tuple(counts)
        return result if kind == "score" else self._step_counts.keep(step, result)

    def shadows(self, policy: str, results: Iterable[ShadowResult], seconds: float) -> None:
        self._shadow_seconds.observe((policy,), seconds)
        for result in results:
            self._shadows.inc((policy, result.decision.policy, result.agreement.value))

    def response(
        self,
        policy: str,
        status: int,
        *,
        completed: bool,
        first_body_seconds: float | None,
        duration_seconds: float,
    ) -> None:
        status_class = f"{status // 100}xx" if completed and status else "aborted"
        labels = (policy,)
        self._responses.inc((policy, status_class))
        if first_body_seconds is not None:
            self._first_token.observe(labels, first_body_seconds)
        if completed:
            self._response_seconds.observe(labels, duration_seconds)

    def latency(
        self,
        decision: Decision,
        *,
        ttft: float | None,
        tpot: float | None,
        ttft_met: bool | None,
        tpot_met: bool | None,
    ) -> None:
        """A completed answer's latencies (seconds) against the prediction and objectives."""
        policy, model = decision.policy, decision.target_model
        if decision.predicted is not None:
            for name, predicted_ms, actual in zip(
                ("ttft", "tpot"), decision.predicted, (ttft, tpot), strict=True
            ):
                if predicted_ms >= 0.0 and actual:
                    error = abs(predicted_ms / 1000.0 - actual) / actual
                    self._prediction_error.observe((policy, model, name), error)
        if ttft_met is not None:
            self._objectives.inc((policy, model, "ttft", "true" if ttft_met else "false"))
        if tpot_met is not None:
            self._objectives.inc((policy, model, "tpot", "true" if tpot_met else "false"))

    def stream_error(self, kind: str, code: str) -> None:
        self._stream_errors.inc((kind, code))

    # -- the pool and the policies --------------------------------------------------

    def retain_pods(self, names: Iterable[str]) -> None:
        """Drop decision series of pods no longer in the pool (bounds the ``pod`` label)."""
        keep = {"", *names}
        self._decisions.drop(lambda labels: labels[2] in keep)

    def policies_loaded(self, policies: PolicySetLike) -> None:
        """The policy set now serving (at start and after each successful reload)."""
        self._policy_info.clear()
        for policy in policies.policies:
            self._policy_info.labels(policy.name, policy.version, "live").set(1)
            for shadow in policy.shadows:
                self._policy_info.labels(shadow.name, shadow.version, "shadow").set(1)
        self._last_reload_time.set(time.time())

    def on_reload(self, reload: ReloadLike) -> None:
        """For ``PolicyStore.watch(on_reload=...)``: count the attempt, show the result."""
        if reload.error is not None:
            self._reloads.inc(("rejected",))
            self._last_reload_ok.set(0)
            return
        self._reloads.inc(("ok",))
        self._last_reload_ok.set(1)
        self.policies_loaded(reload.current)
