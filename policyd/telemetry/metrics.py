"""Prometheus metrics of decisions, shadow policies, responses, streams and reloads.

Every series has bounded labels: ``policy`` and ``node`` come from the loaded
policy files, ``pod`` from the pool (series of pods that left are dropped by
``retain_pods``), the rest are small fixed sets. Recording happens off the
live reply (``RequestRecord.after_reply`` / ``end``); each labelled child is
looked up once and cached, so a decision costs dictionary lookups and lock-free
``inc``/``observe`` calls on prometheus-client's values.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from policyd.policy.decision import Decision, ShadowResult

DECISION_BUCKETS: Final = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
)  # fmt: skip
RESPONSE_BUCKETS: Final = (
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
_COUNTED_KINDS: Final = frozenset({"filter", "band", "top-k"})  # nodes that keep pods


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


class _Children:
    """A labelled metric's children, looked up once per label set."""

    __slots__ = ("_cache", "metric")

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._cache: dict[tuple[str, ...], Any] = {}

    def get(self, *labels: str) -> Any:
        child = self._cache.get(labels)
        if child is None:
            child = self._cache[labels] = self.metric.labels(*labels)
        return child

    def drop(self, keep: Any) -> None:
        """Remove every label set for which ``keep(labels)`` is false."""
        for labels in [labels for labels in self._cache if not keep(labels)]:
            del self._cache[labels]
            self.metric.remove(*labels)


class DecisionMetrics:
    """The metrics of the serving path, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._decision_seconds = _Children(
            Histogram(
                "policyd_decision_duration_seconds",
                "Time Router.decide took for one request.",
                ["policy"],
                buckets=DECISION_BUCKETS,
                registry=r,
            )
        )
        self._decisions = _Children(
            Counter(
                "policyd_decisions",
                "Routing decisions by policy, outcome and picked pod ('' when not routed).",
                ["policy", "outcome", "pod"],
                registry=r,
            )
        )
        self._node_visits = _Children(
            Counter(
                "policyd_filter_node_visits",
                "Filter-tree nodes visited, by the branch the walk took.",
                ["policy", "node", "kind", "branch"],
                registry=r,
            )
        )
        self._node_pods = _Children(
            Counter(
                "policyd_filter_node_pods",
                "Pods that entered a filter, band or top-k node, by whether they were kept.",
                ["policy", "node", "result"],
                registry=r,
            )
        )
        self._node_errors = _Children(
            Counter(
                "policyd_filter_node_errors",
                "CEL errors while evaluating a node (or the scorers, node 'score') on a pod.",
                ["policy", "node"],
                registry=r,
            )
        )
        self._shadows = _Children(
            Counter(
                "policyd_shadow_decisions",
                "Shadow-policy decisions by how they compare with the live one "
                "(same-pod, same-outcome agree; other-pod, other-outcome do not).",
                ["policy", "shadow", "agreement"],
                registry=r,
            )
        )
        self._shadow_seconds = _Children(
            Histogram(
                "policyd_shadow_evaluation_duration_seconds",
                "Time spent deciding one request under all of a policy's shadows.",
                ["policy"],
                buckets=DECISION_BUCKETS,
                registry=r,
            )
        )
        self._first_token = _Children(
            Histogram(
                "policyd_response_time_to_first_token_seconds",
                "From the decision to the first response body bytes.",
                ["policy"],
                buckets=RESPONSE_BUCKETS,
                registry=r,
            )
        )
        self._response_seconds = _Children(
            Histogram(
                "policyd_response_duration_seconds",
                "From the decision to the end of the response.",
                ["policy"],
                buckets=RESPONSE_BUCKETS,
                registry=r,
            )
        )
        self._responses = _Children(
            Counter(
                "policyd_responses",
                "Responses to routed requests by status class (2xx, 4xx, 5xx, aborted).",
                ["policy", "status_class"],
                registry=r,
            )
        )
        self._stream_errors = _Children(
            Counter(
                "policyd_extproc_stream_errors",
                "ext_proc exchanges that went wrong: rejected before a decision (code: the "
                "error code), internal (code: the phase) or aborted (the stream ended first).",
                ["kind", "code"],
                registry=r,
            )
        )
        self._reloads = _Children(
            Counter(
                "policyd_policy_reloads",
                "Policy reload attempts by result (ok, rejected).",
                ["result"],
                registry=r,
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

    # -- per request ------------------------------------------------------------------

    def decision(self, decision: Decision, seconds: float) -> None:
        policy = decision.policy
        self._decision_seconds.get(policy).observe(seconds)
        self._decisions.get(policy, decision.outcome.value, decision.pod).inc()
        for step in decision.trace:
            node = step.node
            if step.kind != "score":
                self._node_visits.get(policy, node, step.kind, step.branch or "end").inc()
            if step.kind in _COUNTED_KINDS:
                kept = len(step.kept)
                if kept:
                    self._node_pods.get(policy, node, "kept").inc(kept)
                if step.candidates_in > kept:
                    self._node_pods.get(policy, node, "dropped").inc(step.candidates_in - kept)
            if step.errors:
                self._node_errors.get(policy, node).inc(len(step.errors))

    def shadows(self, policy: str, results: Iterable[ShadowResult], seconds: float) -> None:
        self._shadow_seconds.get(policy).observe(seconds)
        for result in results:
            self._shadows.get(policy, result.decision.policy, result.agreement.value).inc()

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
        self._responses.get(policy, status_class).inc()
        if first_body_seconds is not None:
            self._first_token.get(policy).observe(first_body_seconds)
        if completed:
            self._response_seconds.get(policy).observe(duration_seconds)

    def stream_error(self, kind: str, code: str) -> None:
        self._stream_errors.get(kind, code).inc()

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
            self._reloads.get("rejected").inc()
            self._last_reload_ok.set(0)
            return
        self._reloads.get("ok").inc()
        self._last_reload_ok.set(1)
        self.policies_loaded(reload.current)
