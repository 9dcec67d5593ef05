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

from policyd.policy.compiler import CompiledPolicy, CompiledPrefill
from policyd.policy.decision import Decision, NodeTrace, Outcome, ShadowResult, Split
from policyd.policy.evaluation import FAILED, Evaluation
from policyd.policy.pods import PolicyPod
from policyd.policy.policyset import PolicySet
from policyd.policy.request import Request
from policyd.policy.router import Router, in_pool
from policyd.policy.scoring import Scorer, clamp


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
class PrefillDetail:
    """A two-stage policy's second stage: its ``when`` on the decode pod, then its walk."""

    when: str  # the predicate's source
    value: str  # its value on the decode pod, or "error: ..."
    nodes: tuple[NodeDetail, ...]
    scores: tuple[ScoreDetail, ...]
    candidates: int  # the prefill-capable pods of the policy's pool


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
    prefill: PrefillDetail | None = None  # a two-stage policy's second stage, once routed


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
    entering = in_pool(policy.pool_labels, pods, policy.roles)
    details, scores = _stage(
        policy, decision.trace, entering, [by_name[name] for name in decision.survivors], ev
    )
    prefill = None
    split = decision.split
    if policy.prefill is not None and split is not None:
        prefill = _prefill(policy.prefill, split, by_name[decision.pod], pods, ev)
    return Explanation(
        decision,
        policy,
        resolved,
        len(pods),
        details,
        scores,
        fallback_pods,
        shadows,
        held,
        predictions,
        prefill,
    )


def _stage(
    stage: CompiledPolicy | CompiledPrefill,
    trace: Sequence[NodeTrace],
    entering: Sequence[PolicyPod],
    survivors: Sequence[PolicyPod],
    ev: Evaluation,
) -> tuple[tuple[NodeDetail, ...], tuple[ScoreDetail, ...]]:
    """Each visited node of one stage's walk with every entering pod's value, and the
    survivors' scores."""
    by_name = {pod.name: pod for pod in entering}
    details: list[NodeDetail] = []
    scores: tuple[ScoreDetail, ...] = ()
    for step in trace:
        if step.kind == "score":
            scores = _scores(stage.scorers, survivors, ev)
            continue
        node = stage.nodes[step.node]
        source, values = node.explain(entering, ev)
        shown: tuple[tuple[str, str], ...] = ()
        if values:  # the kind has a value per pod
            errors = _errors(step, entering)
            shown = tuple(
                (pod.name, _show(value, error))
                for pod, value, error in zip(entering, values, errors, strict=True)
            )
        details.append(NodeDetail(step, source, node.description, shown))
        if step.branch == "on_success":
            entering = [by_name[name] for name in step.kept]
    return tuple(details), scores


def _prefill(
    prefill: CompiledPrefill,
    split: Split,
    decode: PolicyPod,
    pods: Sequence[PolicyPod],
    ev: Evaluation,
) -> PrefillDetail:
    values, errors = prefill.when.values((decode,), ev)
    value = _show(values[0], errors[0][1] if errors else "")
    entering = in_pool(prefill.pool_labels, pods, prefill.roles)
    by_name = {pod.name: pod for pod in pods}
    survivors = [by_name[name] for name in split.survivors]
    details, scores = _stage(prefill, split.trace, entering, survivors, ev)
    return PrefillDetail(prefill.when.source, value, details, scores, len(entering))


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
    scorers: Sequence[Scorer], pods: Sequence[PolicyPod], ev: Evaluation
) -> tuple[ScoreDetail, ...]:
    columns = [scorer.expression.values(pods, ev) for scorer in scorers]
    details: list[ScoreDetail] = []
    for index, pod in enumerate(pods):
        total = 0.0
        parts: list[tuple[str, str]] = []
        for scorer, (values, errors) in zip(scorers, columns, strict=True):
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
    if policy is not None and policy.prefill is not None:
        lines.append("")
        lines.append(f"decode stage: the pods of role {_roles(policy.roles)}")
    lines += _walk_lines(explanation.nodes)
    if explanation.scores:
        assert policy is not None
        lines += _score_lines(policy.picker.name, policy.scorers, explanation.scores)
    lines.append("")
    if explanation.held:
        lines.append(f"flow      {explanation.held}; once dispatched:")
    lines.append(_outcome_line(explanation))
    if explanation.prefill is not None and policy is not None and policy.prefill is not None:
        lines += _prefill_lines(explanation, policy.prefill, explanation.prefill)
    for shadow in explanation.shadows:
        lines.append(_shadow_line(shadow))
    return "\n".join(lines) + "\n"


def _roles(roles: frozenset[str] | None) -> str:
    return " or ".join(sorted(roles or ()))


def _prefill_lines(
    explanation: Explanation, prefill: CompiledPrefill, detail: PrefillDetail
) -> list[str]:
    """The split decision and, when ``when`` held, the prefill stage's walk and pick."""
    split = explanation.decision.split
    assert split is not None
    lines = ["", f"split     when: {detail.when}", f"   {explanation.decision.pod}  {detail.value}"]
    if detail.nodes or detail.scores:
        lines.append("")
        lines.append(
            f"prefill stage: the pods of role {_roles(prefill.roles)}"
            f" ({detail.candidates}), without the decode pod"
        )
    lines += _walk_lines(detail.nodes)
    if detail.scores:
        lines += _score_lines(prefill.picker.name, prefill.scorers, detail.scores)
    lines.append("")
    if split.split:
        lines.append(
            f"prefill   {split.pod} ({split.endpoint}) by {prefill.picker.name} among"
            f" {len(split.survivors)}: split ({split.reason})"
        )
    else:
        note = f": {split.note}" if split.note else ""
        lines.append(f"prefill   none: not split ({split.reason}){note}")
    return lines


def _walk_lines(nodes: Sequence[NodeDetail]) -> list[str]:
    """One block per visited node: each entering pod's value, and where the walk went."""
    lines: list[str] = []
    for number, node in enumerate(nodes, start=1):
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
    return lines


def _score_lines(
    picker: str, scorers: Sequence[Scorer], scores: Sequence[ScoreDetail]
) -> list[str]:
    lines = ["", f"scores ({picker}, each clamped to [0, 1], times its weight)"]
    header = ["pod", "total", *(f"{s.name} x{s.weight:g}" for s in scorers)]
    rows = [
        [detail.pod, f"{detail.total:.4g}", *(value for _, value in detail.parts)]
        for detail in scores
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        lines.append(
            "   " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        )
    return lines


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
        "nodes": [_node_json(n) for n in explanation.nodes],
        "scores": [_score_json(s) for s in explanation.scores],
        "split": _split_json(explanation),
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


def _split_json(explanation: Explanation) -> dict[str, Any] | None:
    """A two-stage policy's split decision and prefill stage (None: none was made)."""
    split = explanation.decision.split
    detail = explanation.prefill
    if split is None or detail is None:
        return None
    return {
        "split": split.split,
        "reason": split.reason,
        "note": split.note,
        "when": detail.when,
        "when_value": detail.value,
        "pod": split.pod,
        "endpoint": split.endpoint,
        "survivors": list(split.survivors),
        "nodes": [_node_json(n) for n in detail.nodes],
        "scores": [_score_json(s) for s in detail.scores],
    }


def _node_json(n: NodeDetail) -> dict[str, Any]:
    return {
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


def _score_json(s: ScoreDetail) -> dict[str, Any]:
    return {"pod": s.pod, "total": s.total, "scorers": dict(s.parts)}
