"""Evaluating compiled CEL over pods during one decision.

One ``Evaluation`` lives for one decision. Expressions that use no variables
share a single activation dict whose ``pod`` entry is rebound per pod, so a
pod costs no allocation. Expressions that use ``variables.x`` get a small dict
per pod that memoises each variable the first time any node needs it for that
pod: a variable is evaluated at most once per pod and decision, and only for
pods that reach a node using it.

A failing variable makes every expression that uses it fail for that pod, with
the variable named in the error, whatever the expression would have made of it.

``Compiling`` is what the compiler offers a policy kind (``policyd.policy.kinds``)
to turn the kind's CEL into such expressions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from policyd.cel import Activation, CelEvalError
from policyd.policy.pods import PolicyPod
from policyd.policy.reader import Expression
from policyd.policy.request import Request

Evaluator = Callable[[Activation], Any]
Needs = tuple[tuple[str, Evaluator], ...]  # variables an expression uses, dependencies first
BOOL: Final = ("BOOL",)  # the CEL types an expression may have (``want``)
NUMBERS: Final = ("INT", "UINT", "DOUBLE")


class Compiling(Protocol):
    """What the compiler does for a kind: check and compile one of its expressions.

    Each reports any error at its place in the file (``what`` names the place,
    ``want`` lists the CEL types allowed) and returns None then.
    """

    def pod_expression(
        self, expression: Expression, *, what: str, want: tuple[str, ...]
    ) -> PodExpression | None:
        """Over ``pod``, ``request``, params and variables; evaluated per pod."""
        ...

    def request_expression(
        self, expression: Expression, *, what: str, want: tuple[str, ...], sees: str
    ) -> Evaluator | None:
        """Over ``request`` and params only; ``sees`` explains that when it names a pod."""
        ...


class _Failed:
    """Marks a pod whose expression failed (never a CEL value)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "FAILED"


FAILED: Final = _Failed()


class Evaluation:
    """Activation state for one decision over one request."""

    __slots__ = ("_failures", "_scopes", "activation", "request")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.activation: dict[str, Any] = {"request": request, "pod": None}
        self._scopes: dict[int, dict[str, Any]] = {}  # id(pod) -> its activation
        self._failures: dict[tuple[int, str], str] = {}  # (id(pod), variable) -> error

    def scope(self, pod: PolicyPod, needs: Needs) -> dict[str, Any]:
        """The pod's own activation, with every variable in ``needs`` evaluated.

        Raises ``CelEvalError`` naming the first needed variable that failed for
        this pod (remembered, so it is not evaluated again).
        """
        key = id(pod)
        scope = self._scopes.get(key)
        if scope is None:
            scope = {"request": self.request, "pod": pod}
            self._scopes[key] = scope
        for name, evaluate in needs:
            if name in scope:
                continue
            failure = self._failures.get((key, name))
            if failure is None:
                try:
                    scope[name] = evaluate(scope)
                    continue
                except CelEvalError as error:
                    failure = self._failures[key, name] = f"{name}: {error}"
            raise CelEvalError(failure)
        return scope


@dataclass(frozen=True, slots=True)
class PodExpression:
    """A compiled per-pod expression and the variables it needs."""

    source: str
    evaluate: Evaluator
    needs: Needs

    def values(
        self, pods: Sequence[PolicyPod], ev: Evaluation
    ) -> tuple[list[Any], list[tuple[str, str]]]:
        """The value for each pod (``FAILED`` where it failed) and the errors."""
        evaluate = self.evaluate
        values: list[Any] = []
        errors: list[tuple[str, str]] = []
        if self.needs:
            needs = self.needs
            scope = ev.scope
            for pod in pods:
                try:
                    values.append(evaluate(scope(pod, needs)))
                except CelEvalError as error:
                    values.append(FAILED)
                    errors.append((pod.name, str(error)))
            return values, errors
        activation = ev.activation
        for pod in pods:
            activation["pod"] = pod
            try:
                values.append(evaluate(activation))
            except CelEvalError as error:
                values.append(FAILED)
                errors.append((pod.name, str(error)))
        return values, errors

    def select(
        self, pods: Sequence[PolicyPod], ev: Evaluation, *, keep_failed: bool
    ) -> tuple[list[PolicyPod], list[tuple[str, str]]]:
        """The pods for which the expression is ``true``, and the errors.

        Written out rather than filtering ``values()``: the extra list and pass
        would make a decision over 100 pods visibly slower
        (``benchmarks/decision.py``).
        """
        evaluate = self.evaluate
        kept: list[PolicyPod] = []
        errors: list[tuple[str, str]] = []
        if self.needs:
            needs = self.needs
            scope = ev.scope
            for pod in pods:
                try:
                    result = evaluate(scope(pod, needs))
                except CelEvalError as error:
                    errors.append((pod.name, str(error)))
                    if keep_failed:
                        kept.append(pod)
                    continue
                if result is True:
                    kept.append(pod)
            return kept, errors
        activation = ev.activation
        for pod in pods:
            activation["pod"] = pod
            try:
                result = evaluate(activation)
            except CelEvalError as error:
                errors.append((pod.name, str(error)))
                if keep_failed:
                    kept.append(pod)
                continue
            if result is True:
                kept.append(pod)
        return kept, errors
