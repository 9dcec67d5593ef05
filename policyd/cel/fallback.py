"""Evaluate with cel-expr-python (Google's cel-cpp) what the compiler does not lower.

Slower (the activation is converted to cel-cpp values on every call) but
exact, with two limits of the bridge that the compile report states:
timestamps and durations *returned* by a fallback program are rounded to
microseconds (cel-expr-python hands back ``datetime`` values), and a ``uint``
used as a map key comes back as a plain ``int``.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Final

from cel_expr_python import cel
from google.protobuf import duration_pb2, message_factory, timestamp_pb2, wrappers_pb2

from policyd.cel.errors import CelEvalError
from policyd.cel.schema import descriptor_pool_for_schema
from policyd.cel.values import (
    NANOS_PER_SECOND,
    CelType,
    Duration,
    Timestamp,
    UInt,
)

_EPOCH: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_TYPE_NAMES: Final = {
    "INT": "int",
    "UINT": "uint",
    "DOUBLE": "double",
    "BOOL": "bool",
    "STRING": "string",
    "BYTES": "bytes",
    "NULL": "null_type",
    "TYPE": "type",
    "DURATION": "google.protobuf.Duration",
    "TIMESTAMP": "google.protobuf.Timestamp",
}


class FallbackEvaluator:
    """``evaluate(activation)`` through cel-cpp: convert the activation, evaluate,
    convert the result back. Calling the instance is ``evaluate``."""

    def __init__(
        self,
        expression: cel.Expression,
        variables: Mapping[str, cel.Type],
        constants: Mapping[str, Any],
    ) -> None:
        pool = descriptor_pool_for_schema()
        self._expression = expression
        self._constants = dict(constants)
        self._message_classes = {
            name: message_factory.GetMessageClass(pool.FindMessageTypeByName(declared.name()))
            for name, declared in variables.items()
            if declared.is_message()
        }
        self._uint_variables = frozenset(
            name for name, declared in variables.items() if declared.name() == "UINT"
        )

    def convert(self, activation: Mapping[str, Any]) -> dict[str, Any]:
        """The activation (and constants) as cel-expr-python takes them."""
        converted = {}
        for name, value in {**self._constants, **activation}.items():
            if name in self._message_classes:
                converted[name] = _to_message(self._message_classes[name], value)
            elif name in self._uint_variables:
                converted[name] = int(value)
            else:
                converted[name] = _to_cel(value)
        return converted

    def evaluate_converted(self, converted: Mapping[str, Any]) -> Any:
        try:
            result = self._expression.eval(data=converted)
        except Exception as error:
            raise CelEvalError(f"cannot evaluate with cel-expr-python: {error}") from None
        return from_cel_value(result)

    def __call__(self, activation: Mapping[str, Any]) -> Any:
        try:
            converted = self.convert(activation)
        except Exception as error:
            raise CelEvalError(
                f"cannot convert the activation for cel-expr-python: {error}"
            ) from None
        return self.evaluate_converted(converted)


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


def _to_cel(value: Any) -> Any:
    """A Python value as cel-expr-python accepts it, nanoseconds and uints kept."""
    if isinstance(value, UInt):
        return wrappers_pb2.UInt64Value(value=int(value))
    if isinstance(value, Duration):
        duration = duration_pb2.Duration()
        duration.FromNanoseconds(value.nanos)
        return duration
    if isinstance(value, Timestamp):
        timestamp = timestamp_pb2.Timestamp()
        timestamp.FromNanoseconds(value.nanos)
        return timestamp
    if isinstance(value, Mapping):
        return {int(k) if isinstance(k, UInt) else k: _to_cel(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_to_cel(item) for item in value]
    return value


def from_cel_value(result: cel.Value) -> Any:
    """A cel-expr-python result as the values of ``policyd.cel.values``."""
    type_name = result.type().name()
    if type_name == "ERROR":
        raise CelEvalError(str(result.value()))
    value = result.value()
    if type_name == "UINT":
        return UInt(value)
    if type_name == "TIMESTAMP":
        delta = value - _EPOCH
        return Timestamp(
            (delta.days * 86_400 + delta.seconds) * NANOS_PER_SECOND + delta.microseconds * 1_000
        )
    if type_name == "DURATION":
        return Duration(
            (value.days * 86_400 + value.seconds) * NANOS_PER_SECOND + value.microseconds * 1_000
        )
    if type_name == "TYPE":
        return CelType(type_name_of(value))
    if type_name == "BYTES":
        return bytes(value)
    if type_name.startswith("LIST"):
        return [from_cel_value(item) for item in value]
    if type_name.startswith("MAP"):
        return {key: from_cel_value(item) for key, item in value.items()}
    return value


def type_name_of(value: cel.Type) -> str:
    """The CEL name of a cel-expr-python type value (``LIST<INT>`` -> ``list``)."""
    name = str(value.name())
    base = name.split("<", 1)[0]
    if base in ("LIST", "MAP"):
        return base.lower()
    return _TYPE_NAMES.get(base, name)
