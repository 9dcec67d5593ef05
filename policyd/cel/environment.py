"""Compile CEL source against declared variables into a callable ``Program``.

Parsing and type checking are Google's cel-cpp (``cel-expr-python``): the
checker is the authority on what a valid rule is. Evaluation of a compiled
program goes through ``Program.evaluate(activation)``, where ``activation`` maps
each declared variable name to a plain Python value (objects with attributes
for ``pod`` / ``request``).

This module holds the slow-but-exact fallback evaluator: the activation is
converted to cel-cpp values on every call. The lowering compiler replaces it
wherever it can and reports where it could not.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cel_expr_python import cel
from google.protobuf import message_factory

from policyd.cel.errors import CelCompileError, CelEvalError
from policyd.cel.schema import descriptor_pool_for_schema
from policyd.cel.values import NANOS_PER_SECOND, Duration

Activation = Mapping[str, Any]
Evaluator = Callable[[Activation], Any]

_POSITION = re.compile(r"<input>:(\d+):(\d+): (.*)")


@dataclass(frozen=True, slots=True)
class Program:
    """A compiled expression: call ``evaluate(activation)`` per input.

    ``evaluate`` returns a plain Python value or raises ``CelEvalError``; no
    other exception escapes it.
    """

    source: str
    return_type: str
    evaluate: Evaluator
    lowered: bool
    report: tuple[str, ...] = field(default=())


class Environment:
    """Variables a family of expressions may use, with their CEL types."""

    def __init__(self, variables: Mapping[str, cel.Type]) -> None:
        self._variables = dict(variables)
        self._env = cel.NewEnv(
            descriptor_pool=descriptor_pool_for_schema(), variables=self._variables
        )

    @property
    def variables(self) -> Mapping[str, cel.Type]:
        return self._variables

    def check(self, source: str) -> cel.Expression:
        """Parse and type-check ``source`` or raise ``CelCompileError``."""
        try:
            return self._env.compile(source)
        except RuntimeError as error:
            raise _compile_error(str(error)) from None

    def compile(self, source: str, *, constants: Activation | None = None) -> Program:
        """Compile ``source``; ``constants`` are variable values known at load time."""
        expression = self.check(source)
        evaluate = _fallback_evaluator(expression, self._variables, dict(constants or {}))
        return Program(
            source=source,
            return_type=expression.return_type().name(),
            evaluate=evaluate,
            lowered=False,
            report=("evaluated by cel-expr-python (not lowered)",),
        )


def _compile_error(text: str) -> CelCompileError:
    match = _POSITION.search(text)
    if match is None:
        return CelCompileError(text.strip())
    message = match.group(3).split(" | ")[0].strip()
    message = re.sub(r"\s*\[INVALID_ARGUMENT\]$", "", message)
    return CelCompileError(message, int(match.group(1)), int(match.group(2)))


def _fallback_evaluator(
    expression: cel.Expression, variables: Mapping[str, cel.Type], constants: dict[str, Any]
) -> Evaluator:
    message_classes = {
        name: message_factory.GetMessageClass(
            descriptor_pool_for_schema().FindMessageTypeByName(declared.name())
        )
        for name, declared in variables.items()
        if declared.is_message()
    }

    def evaluate(activation: Activation) -> Any:
        data = {**constants, **activation}
        try:
            for name, message_class in message_classes.items():
                if name in data:
                    data[name] = _to_message(message_class, data[name])
            converted = {name: _to_cel_input(value) for name, value in data.items()}
            result = expression.eval(data=converted)
        except Exception as error:
            raise CelEvalError(f"cannot evaluate with cel-expr-python: {error}") from None
        if result.type().name() == "ERROR":
            raise CelEvalError(str(result.value()))
        return _from_cel_output(result.plain_value())

    return evaluate


def _to_message(message_class: Any, value: Any) -> Any:
    message = message_class()
    for descriptor in message.DESCRIPTOR.fields:
        attribute = getattr(value, descriptor.name)
        target = getattr(message, descriptor.name)
        if descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
            target.update(attribute)
        elif descriptor.is_repeated:
            target.extend(attribute)
        elif isinstance(attribute, Duration):
            target.FromNanoseconds(attribute.nanos)
        else:
            setattr(message, descriptor.name, attribute)
    return message


def _to_cel_input(value: Any) -> Any:
    if isinstance(value, Duration):
        return datetime.timedelta(microseconds=value.nanos / 1000)
    if isinstance(value, tuple):
        return [_to_cel_input(item) for item in value]
    return value


def _from_cel_output(value: Any) -> Any:
    if isinstance(value, datetime.timedelta):
        return Duration(
            (value.days * 86_400 + value.seconds) * NANOS_PER_SECOND + value.microseconds * 1000
        )
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, list):
        return [_from_cel_output(item) for item in value]
    if isinstance(value, dict):
        return {_from_cel_output(k): _from_cel_output(v) for k, v in value.items()}
    return value
