"""The filter-tree node kinds. They share one shape: ``visit(pods, ev) -> Visit``.

The walk semantics are those of the Gateway API Inference Extension's original
scheduler: a filtering node *succeeds* when it keeps at least one pod; on
success the kept pods go on to ``on_success``, on failure the node's *input*
goes on to ``on_failure``; a node with nowhere to go ends the walk with its
own result (so a failing node without ``on_failure`` ends it with no pods).

Nodes are built leaves first (the tree is acyclic, the loader checks), so a
node holds its successors directly and the whole tree is immutable.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from policyd.cel import CelEvalError
from policyd.policy.decision import NodeTrace
from policyd.policy.evaluation import FAILED, Evaluation, Evaluator, PodExpression

_pod_name = operator.attrgetter("name")


def pod_names(pods: Sequence[Any]) -> tuple[str, ...]:
    return tuple(map(_pod_name, pods))


# What one node did: its trace, the pods handed on, the next node (None: the walk
# ends), and a shed reason (non-empty: stop and answer 429). A plain tuple, as it
# is built once per node and decision.
Visit = tuple[NodeTrace, Sequence[Any], "Node | None", str]


@dataclass(frozen=True, slots=True, eq=False)
class _Filtering:
    """What the filtering kinds (keep, band, top-k) have in common."""

    name: str
    description: str
    expression: PodExpression
    keep_failed: bool  # on_error: pass
    on_success: Node | None
    on_failure: Node | None

    def _continue(
        self,
        kind: str,
        pods: Sequence[Any],
        kept: list[Any],
        errors: list[tuple[str, str]],
        band: tuple[float, float] | None = None,
    ) -> Visit:
        forward: Sequence[Any] = kept
        if kept:
            following, branch = self.on_success, "on_success"
        else:
            following, branch = self.on_failure, "on_failure"
            if following is not None:
                forward = pods
        trace = NodeTrace(
            self.name,
            kind,
            len(pods),
            pod_names(kept),
            tuple(errors),
            branch,
            following.name if following is not None else "",
            "",
            band,
        )
        return trace, forward, following, ""


@dataclass(frozen=True, slots=True, eq=False)
class KeepNode(_Filtering):
    """``keep: <bool CEL>``: the pods for which the predicate is true."""

    kind: ClassVar[str] = "filter"

    def visit(self, pods: Sequence[Any], ev: Evaluation) -> Visit:
        kept, errors = self.expression.select(pods, ev, keep_failed=self.keep_failed)
        return self._continue(self.kind, pods, kept, errors)


@dataclass(frozen=True, slots=True, eq=False)
class BandNode(_Filtering):
    """``band: <number CEL>``: the pods within ``[min, min + (max - min) / N]``.

    N is the number of pods entering the node, as in the original "least
    queuing" and "least KV cache" filters. For an int value the test
    ``value <= min + (max - min) / N`` equals the original's integer division,
    because an integer is at most x exactly when it is at most floor(x).
    Pods whose value failed are left out of min and max.
    """

    kind: ClassVar[str] = "band"

    def visit(self, pods: Sequence[Any], ev: Evaluation) -> Visit:
        values, errors = self.expression.values(pods, ev)
        numbers = [v for v in values if v is not FAILED] if errors else values
        if not numbers:
            kept = list(pods) if self.keep_failed else []
            return self._continue(self.kind, pods, kept, errors)
        low = min(numbers)
        limit = low + (max(numbers) - low) / len(pods)
        if errors:
            keep_failed = self.keep_failed
            kept = [
                pod
                for pod, value in zip(pods, values, strict=True)
                if (value is FAILED and keep_failed) or (value is not FAILED and value <= limit)
            ]
        else:
            kept = [pod for pod, value in zip(pods, values, strict=True) if value <= limit]
        return self._continue(self.kind, pods, kept, errors, (low, limit))


@dataclass(frozen=True, slots=True, eq=False)
class TopKNode(_Filtering):
    """``top_k: K`` with ``lowest:`` or ``highest:``: the K pods with the extreme values.

    Ties at the cut go to the pod that comes first among the candidates; the
    kept pods stay in candidate order.
    """

    k: int
    highest: bool

    kind: ClassVar[str] = "top-k"

    def visit(self, pods: Sequence[Any], ev: Evaluation) -> Visit:
        values, errors = self.expression.values(pods, ev)
        ranked = [i for i, value in enumerate(values) if value is not FAILED]
        if len(ranked) > self.k:
            choose = heapq.nlargest if self.highest else heapq.nsmallest
            ranked = sorted(choose(self.k, ranked, key=values.__getitem__))
        if errors and self.keep_failed:
            ranked = sorted({*ranked, *(i for i, v in enumerate(values) if v is FAILED)})
        kept = [pods[i] for i in ranked]
        return self._continue(self.kind, pods, kept, errors)


@dataclass(frozen=True, slots=True, eq=False)
class ConditionNode:
    """``if: <bool CEL over request>``: choose a branch; every pod goes on.

    It runs once per request. An error takes the ``else`` branch and is traced.
    Its trace leaves ``kept`` empty: every pod goes on (``candidates_in`` of them).
    """

    name: str
    description: str
    source: str
    evaluate: Evaluator
    then: Node | None
    otherwise: Node | None

    kind: ClassVar[str] = "condition"

    def visit(self, pods: Sequence[Any], ev: Evaluation) -> Visit:
        errors: tuple[tuple[str, str], ...] = ()
        try:
            result = self.evaluate(ev.activation) is True
        except CelEvalError as error:
            result, errors = False, (("", str(error)),)
        following, branch = (self.then, "then") if result else (self.otherwise, "else")
        trace = NodeTrace(
            self.name,
            self.kind,
            len(pods),
            (),
            errors,
            branch,
            following.name if following is not None else "",
            "error" if errors else str(result).lower(),
        )
        return trace, pods, following, ""


@dataclass(frozen=True, slots=True, eq=False)
class ShedNode:
    """``shed: <reason>``: stop; the request is answered 429 with the reason."""

    name: str
    description: str
    reason: str

    kind: ClassVar[str] = "shed"

    def visit(self, pods: Sequence[Any], ev: Evaluation) -> Visit:
        trace = NodeTrace(self.name, self.kind, len(pods), (), note=self.reason)
        return trace, (), None, self.reason


Node = KeepNode | BandNode | TopKNode | ConditionNode | ShedNode
