"""Prometheus metrics of decisions, shadow policies, responses, streams and reloads.

Every series has bounded labels: ``policy`` and ``node`` come from the loaded
policy files, ``model_server_endpoint`` (the pod's name; llm-d's label for a
model server, since the ``pod`` label is the scrape target's own) from the
pool (series of pods that left are dropped by ``retain_pods``),
``model_name`` is capped (``BoundedLabels``), the rest are small fixed sets.
Recording happens off the live reply (``RequestRecord.after_reply`` / ``end``)
into lock-free tallies, so a decision costs a few dictionary updates.

Each worker process serves its own registry (``--workers``: port + index),
with its own ``process_*`` families and its index in ``policyd_build_info``.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Final, Protocol

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from policyd import __version__
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
ENDPOINT: Final = "model_server_endpoint"  # the label naming a model-server pod
MODEL: Final = "model_name"  # the label naming a model: a base model or an adapter
MAX_FLOW_LABELS: Final = 100  # distinct flow names with series of their own; the rest: "other"
# Distinct model names with series of their own beyond the pool's (llm-d's cap).
MAX_MODEL_LABELS: Final = 1000
OTHER: Final = "other"
MAX_LABEL_TEXT: Final = 128  # characters of a label value a client chose


class BoundedLabels:
    """The values of a label that requests choose, bounded as llm-d bounds its model labels.

    Pinned values (``pin``: the models the pool's pods serve, the first
    ``limit`` of them, since pods are not trusted either) always read as
    themselves and take no place. Any other value reads as itself while fewer
    than ``limit`` have been admitted, and as ``"other"`` after that, so a
    client sending new names cannot make new series without end. Admission
    sticks: a value admitted once keeps its series. A value longer than
    ``MAX_LABEL_TEXT`` characters (no model's name) reads as ``"other"`` too.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._pinned: frozenset[str] = frozenset()
        self._admitted: set[str] = set()

    def pin(self, values: Iterable[str]) -> None:
        """Replace the pinned values (a new frozenset: readers on other threads see one whole)."""
        pinned: set[str] = set()
        for value in values:
            if len(pinned) >= self.limit:
                break
            pinned.add(value)
        self._pinned = frozenset(pinned)

    def __call__(self, value: str) -> str:
        if value in self._admitted or value in self._pinned:
            return value
        if len(value) <= MAX_LABEL_TEXT and len(self._admitted) < self.limit:
            self._admitted.add(value)
            return value
        return OTHER


class FlowMetrics:
    """Flow control's held requests and what became of them (``policyd.flow``'s observer).

    The flow key comes from requests (a tenant header, say), so only the first
    ``MAX_FLOW_LABELS`` flow names seen get series of their own. Held requests
    are also counted per requested model (``policyd_model_held_requests``, an
    autoscaler's signal: requests flow control holds do not show in any pod's
    queue), by the raw name as they come and go, and labelled (``models``)
    when Prometheus scrapes, so an increase and its decrease always meet.
    """

    def __init__(self, registry: CollectorRegistry, models: BoundedLabels) -> None:
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
        self._label = BoundedLabels(MAX_FLOW_LABELS)
        # Requested model -> requests held; an entry goes when its count is 0, so
        # the dict is bounded by what flow control holds.
        self._by_model: dict[str, int] = {}
        registry.register(_HeldByModel(self._by_model, models))

    def held(self, band: str, flow: str, change: int, model: str) -> None:
        self._held.labels(band, self._label(flow)).inc(change)
        by_model = self._by_model
        count = by_model.get(model, 0) + change
        if count:
            by_model[model] = count
        else:
            del by_model[model]

    def outcome(self, band: str, flow: str, outcome: str, waited_s: float) -> None:
        self._outcomes.inc((band, self._label(flow), outcome))
        if outcome != "refused":  # a refused request was never held
            self._wait.observe((band, outcome), waited_s)


class _HeldByModel(Collector):
    """``policyd_model_held_requests``, labelled at collection (see ``FlowMetrics``).

    Labelling admits a new name from the scrape's thread while the event loop
    may admit one too: the cap then holds to within a name or two, never more.
    """

    def __init__(self, by_model: dict[str, int], models: BoundedLabels) -> None:
        self._by_model = by_model
        self._models = models

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        totals: dict[str, float] = {}
        for model, count in dict(self._by_model).items():  # one copy: the loop writes it
            label = self._models(model)
            totals[label] = totals.get(label, 0) + count
        family = GaugeMetricFamily(
            "policyd_model_held_requests",
            "Requests flow control holds now, by the model they ask for.",
            labels=[MODEL],
        )
        for label, total in totals.items():
            family.add_metric([label], total)
        yield family


class DecisionMetrics:
    """The metrics of the serving path, in their own registry.

    The per-request ones are tallies (:mod:`policyd.telemetry.tally`), written
    from the event loop without locks; the reload gauges are
    prometheus-client's own.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, worker: int = 0) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # The model a request was routed for (after the policy's rewrite), bounded.
        self.models = BoundedLabels(MAX_MODEL_LABELS)
        self._decision_seconds = HistogramTally(
            "policyd_decision_duration_seconds",
            "Time Router.decide took for one request.",
            ["policy"],
            DECISION_BUCKETS,
        )
        self._decisions = CounterTally(
            "policyd_decisions",
            "Routing decisions by policy, outcome, picked pod ('' when not routed) and "
            "target model.",
            ["policy", "outcome", ENDPOINT, MODEL],
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
            ["policy", MODEL],
            RESPONSE_BUCKETS,
        )
        self._response_seconds = HistogramTally(
            "policyd_response_duration_seconds",
            "From the decision to the end of the response.",
            ["policy", MODEL],
            RESPONSE_BUCKETS,
        )
        self._responses = CounterTally(
            "policyd_responses",
            "Responses to routed requests by status class (2xx, 4xx, 5xx, aborted).",
            ["policy", MODEL, "status_class"],
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
            ["policy", MODEL, "latency"],
            ERROR_BUCKETS,
        )
        self._objectives = CounterTally(
            "policyd_slo_requests",
            "Completed requests that stated a latency objective (ttft or tpot), by whether"
            " the answer met it (true, false).",
            ["policy", MODEL, "objective", "met"],
        )
        self._splits = CounterTally(
            "policyd_pd_decisions",
            "Routed requests of two-stage (prefill/decode) policies by whether they were split"
            " (true, false) and why (when-true, when-false, when-error, no-prefill-pod).",
            ["policy", "split", "reason"],
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
                    self._splits,
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
        build = Gauge(
            "policyd_build_info",
            "policyd's version, the Python it runs on and the worker's index (value 1).",
            ["version", "python_version", "worker"],
            registry=r,
        )
        build.labels(__version__, platform.python_version(), str(worker)).set(1)
        ProcessCollector(registry=r)  # this worker's process_* (CPU, memory, descriptors)
        self.flow = FlowMetrics(r, self.models)
        # Tally increments per step of a reused walk, and per walk (its trace).
        self._step_counts: IdentityCache[NodeTrace, _StepCounts] = IdentityCache(_STEPS_KEPT)
        self._walk_counts: IdentityCache[tuple[NodeTrace, ...], _StepCounts] = IdentityCache(
            _STEPS_KEPT
        )

    # -- per request ------------------------------------------------------------------

    def decision(self, decision: Decision, seconds: float) -> None:
        policy = decision.policy
        self._decision_seconds.observe((policy,), seconds)
        model = self.models(decision.target_model)
        self._decisions.inc((policy, decision.outcome.value, decision.pod, model))
        split = decision.split
        if split is not None:
            self._splits.inc((policy, "true" if split.split else "false", split.reason))
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
        model: str,
        status: int,
        *,
        completed: bool,
        first_body_seconds: float | None,
        duration_seconds: float,
    ) -> None:
        status_class = f"{status // 100}xx" if completed and status else "aborted"
        labels = (policy, self.models(model))
        self._responses.inc((*labels, status_class))
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
        policy, model = decision.policy, self.models(decision.target_model)
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
        """Drop decision series of pods no longer in the pool (bounds the endpoint label)."""
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
