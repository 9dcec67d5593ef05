"""Why a request would go where it goes: the tree walk with every pod's value.

``explain`` runs the real router (over pods written by hand: their
``predicted_*`` fields are what the file says, as any other field), then
re-evaluates each visited node's expression on the pods that entered it (CEL
is pure, so the values are the ones the router saw) and every scorer on the
survivors. The router's hot path
stays lean; the detail is computed only here. What a node shows is its kind's
(``Node.explain``); the summary under it follows from its trace.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from policyd.policy.compiler import CompiledPolicy
from policyd.policy.decision import Decision, NodeTrace, Outcome, ShadowResult
from policyd.policy.evaluation import FAILED, Evaluation
from policyd.policy.pods import PolicyPod
from policyd.policy.policyset import PolicySet
from policyd.policy.request import Request
from policyd.policy.router import Router, in_pool
from policyd.policy.scoring import clamp


@dataclass(frozen=True, slots=True)
class NodeDetail:
    trace: NodeTrace
    expression: str
    description: str
    values: tuple[tuple[str, str], ...]  # (pod name, value or "error: ...")


@dataclass(frozen=True, slots=True)
class ScoreDetail:
    pod: str
    total: float
    parts: tuple[tuple[str, str], ...]  # (scorer, clamped value or "error: ...")


@dataclass(frozen=True, slots=True)
class Explanation:
    decision: Decision
    policy: CompiledPolicy | None
    request: Request
    candidates: int
    nodes: tuple[NodeDetail, ...]
    scores: tuple[ScoreDetail, ...]
    fallback_pods: tuple[str, ...]  # names of the decision's fallback endpoints
    shadows: tuple[ShadowResult, ...] = ()  # what each shadow policy would have decided
    held: str = ""  # why flow control would hold the request ("": it would not)
    # For a policy that reads the predicted latencies: each pod's (name, TTFT ms,
    # TPOT ms), -1.0 where it has none yet.
    predictions: tuple[tuple[str, float, float], ...] = ()


def explain(
    policies: PolicySet, request: Request, pods: Sequence[PolicyPod], *, seed: int = 0
) -> Explanation:
    """Decide ``request`` over ``pods`` and gather the detail of every step."""
    router = Router(policies, rng=random.Random(seed))
    held = would_hold(router, request, pods)
    decision = router.decide(request, pods)
    report = router.decide_shadows(decision)
    shadows = report.results if report is not None else ()
    policy = policies.select(request.model, request.headers)
    resolved = request.decided(decision.target_model, decision.criticality)
    by_address = {pod.address: pod.name for pod in pods}
    fallback_pods = tuple(by_address.get(a, a) for a in decision.fallbacks)
    if policy is None:
        return Explanation(
            decision, None, resolved, len(pods), (), (), fallback_pods, shadows, held
        )
    ev = Evaluation(resolved)
    by_name = {pod.name: pod for pod in pods}
    predictions: tuple[tuple[str, float, float], ...] = ()
    if policy.reads_prediction:
        predictions = tuple(
            (pod.name, pod.predicted_ttft_ms, pod.predicted_tpot_ms)
            for pod in in_pool(policy.pool_labels, pods)
        )
    entering = in_pool(policy.pool_labels, pods)
    details: list[NodeDetail] = []
    scores: tuple[ScoreDetail, ...] = ()
    for trace in decision.trace:
        if trace.kind == "score":
            survivors = [by_name[name] for name in decision.survivors]
            scores = _scores(policy, survivors, ev)
            continue
        node = policy.nodes[trace.node]
        source, values = node.explain(entering, ev)
        shown: tuple[tuple[str, str], ...] = ()
        if values:  # the kind has a value per pod
            errors = _errors(trace, entering)
            shown = tuple(
                (pod.name, _show(value, error))
                for pod, value, error in zip(entering, values, errors, strict=True)
            )
        details.append(NodeDetail(trace, source, node.description, shown))
        if trace.branch == "on_success":
            entering = [by_name[name] for name in trace.kept]
    return Explanation(
        decision,
        policy,
        resolved,
        len(pods),
        tuple(details),
        scores,
        fallback_pods,
        shadows,
        held,
        predictions,
    )


def would_hold(router: Router, request: Request, pods: Sequence[PolicyPod]) -> str:
    """Why flow control would hold ``request`` over ``pods`` ("": it would not): every
    pod of the policy's pool is saturated for it. (On the serving path a request is
    also held while others of its policy are.)"""
    admission = router.admission(request)
    if admission is None or admission.room(pods):
        return ""
    band = admission.band
    return (
        f"would be held: every pod is saturated ({admission.flow.saturated.source}); "
        f"band {band.name}, flow {admission.key}, for up to {band.max_wait_s:g}s"
    )


def _errors(trace: NodeTrace, pods: Sequence[PolicyPod]) -> list[str]:
    errors = dict(trace.errors)
    return [errors.get(pod.name, "") for pod in pods]


def _show(value: Any, error: str) -> str:
    if value is FAILED:
        return f"error: {error}"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _scores(
    policy: CompiledPolicy, pods: Sequence[PolicyPod], ev: Evaluation
) -> tuple[ScoreDetail, ...]:
    columns = [scorer.expression.values(pods, ev) for scorer in policy.scorers]
    details: list[ScoreDetail] = []
    for index, pod in enumerate(pods):
        total = 0.0
        parts: list[tuple[str, str]] = []
        for scorer, (values, errors) in zip(policy.scorers, columns, strict=True):
            value = values[index]
            if value is FAILED:
                parts.append((scorer.name, "error: " + dict(errors).get(pod.name, "")))
                continue
            clamped = clamp(value)
            total += scorer.weight * clamped
            parts.append((scorer.name, f"{clamped:g}"))
        details.append(ScoreDetail(pod.name, total, tuple(parts)))
    details.sort(key=lambda d: -d.total)
    return tuple(details)


# --- rendering ------------------------------------------------------------------------


def render_text(explanation: Explanation) -> str:
    """The walk for a terminal: one block per node, then scores and the pick."""
    r = explanation.request
    lines: list[str] = []
    policy = explanation.policy
    if policy is None:
        lines.append(f"no policy serves model '{r.model}'")
    else:
        lines.append(f"policy    {policy.name}  ({policy.path}, version {policy.version})")
        if policy.description:
            lines.append(f"          {policy.description}")
    lines.append(
        f"request   model={r.model} target_model={r.target_model or r.model} "
        f"criticality={r.criticality or '-'}"
    )
    lines.append(f"pods      {explanation.candidates} candidates")
    if explanation.predictions:
        lines.append("predicted (ms; - where the pod has no prediction yet)")
        width = max(len(name) for name, _, _ in explanation.predictions)
        for name, ttft, tpot in explanation.predictions:
            lines.append(f"   {name:<{width}}  ttft {_ms(ttft):<8} tpot {_ms(tpot)}")
    for number, node in enumerate(explanation.nodes, start=1):
        t = node.trace
        lines.append("")
        lines.append(f"{number}. {t.node}  [{t.kind}]  {node.expression or t.note}")
        if node.description:
            lines.append(f"   {node.description}")
        width = max((len(name) for name, _ in node.values), default=0)
        kept = set(t.kept)
        for name, value in node.values:
            mark = "kept" if name in kept else ""
            lines.append(f"   {name:<{width}}  {value:<8} {mark}".rstrip())
        for pod, error in t.errors:
            if not pod:
                lines.append(f"   error: {error}")
        if not t.branch:  # the walk stopped here (shed)
            continue
        if not t.narrows:
            summary = f"   {t.note}"
        else:
            summary = f"   kept {len(t.kept)} of {t.candidates_in}"
            if t.band is not None:
                summary += f", band [{t.band[0]:g}, {t.band[1]:g}]"
        where = f"{t.branch}: {t.next}" if t.next else f"{t.branch}: end of the walk"
        lines.append(f"{summary} -> {where}")
    if explanation.scores:
        assert policy is not None
        lines.append("")
        lines.append(f"scores ({policy.picker.name}, each clamped to [0, 1], times its weight)")
        header = ["pod", "total", *(f"{s.name} x{s.weight:g}" for s in policy.scorers)]
        rows = [
            [detail.pod, f"{detail.total:.4g}", *(value for _, value in detail.parts)]
            for detail in explanation.scores
        ]
        widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
        for row in (header, *rows):
            lines.append(
                "   "
                + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            )
    lines.append("")
    if explanation.held:
        lines.append(f"flow      {explanation.held}; once dispatched:")
    lines.append(_outcome_line(explanation))
    for shadow in explanation.shadows:
        lines.append(_shadow_line(shadow))
    return "\n".join(lines) + "\n"


def _ms(value: float) -> str:
    return "-" if value < 0.0 else f"{value:.4g}"


def _shadow_line(shadow: ShadowResult) -> str:
    d = shadow.decision
    would = f"{d.pod} ({d.endpoint})" if d.outcome is Outcome.ROUTED else d.outcome.value
    verdict = "agrees" if shadow.agreement.agrees else "disagrees"
    return (
        f"shadow    {d.policy} (version {d.policy_version}) would pick {would}: "
        f"{verdict} ({shadow.agreement.value})"
    )


def _outcome_line(explanation: Explanation) -> str:
    d = explanation.decision
    if d.outcome is not Outcome.ROUTED:
        return f"outcome   {d.outcome.value} ({d.outcome.http_status}): {d.reason}"
    picker = explanation.policy.picker.name if explanation.policy else ""
    line = f"pick      {d.pod} ({d.endpoint}) by {picker} among {len(d.survivors)}"
    if d.fallbacks:
        pairs = zip(explanation.fallback_pods, d.fallbacks, strict=True)
        line += "; fallbacks " + ", ".join(f"{name} ({address})" for name, address in pairs)
    return line


def to_json(explanation: Explanation) -> dict[str, Any]:
    """The same content for tools (``policyd explain --json``)."""
    d = explanation.decision
    r = explanation.request
    return {
        "policy": d.policy,
        "policy_version": d.policy_version,
        "request": {
            "model": r.model,
            "target_model": d.target_model,
            "criticality": d.criticality,
        },
        "outcome": d.outcome.value,
        "status": d.outcome.http_status,
        "held": explanation.held or None,
        "reason": d.reason,
        "pod": d.pod,
        "endpoint": d.endpoint,
        "fallbacks": list(d.fallbacks),
        "fallback_pods": list(explanation.fallback_pods),
        "survivors": list(d.survivors),
        "predictions": {
            name: {
                "ttft_ms": ttft if ttft >= 0.0 else None,
                "tpot_ms": tpot if tpot >= 0.0 else None,
            }
            for name, ttft, tpot in explanation.predictions
        },
        "nodes": [
            {
                "node": n.trace.node,
                "kind": n.trace.kind,
                "expression": n.expression,
                "in": n.trace.candidates_in,
                "kept": list(n.trace.kept),
                "branch": n.trace.branch,
                "next": n.trace.next,
                "note": n.trace.note,
                "band": list(n.trace.band) if n.trace.band is not None else None,
                "errors": [{"pod": pod, "error": error} for pod, error in n.trace.errors],
                "values": dict(n.values),
            }
            for n in explanation.nodes
        ],
        "scores": [
            {"pod": s.pod, "total": s.total, "scorers": dict(s.parts)} for s in explanation.scores
        ],
        "shadows": [
            {
                "policy": s.decision.policy,
                "policy_version": s.decision.policy_version,
                "outcome": s.decision.outcome.value,
                "pod": s.decision.pod,
                "endpoint": s.decision.endpoint,
                "reason": s.decision.reason,
                "agreement": s.agreement.value,
            }
            for s in explanation.shadows
        ],
    }
