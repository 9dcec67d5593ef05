"""Typed, position-aware reading of YAML mappings, shared by policies and policy tests.

A ``Fields`` reader wraps one mapping: it hands out values of the expected
shape, reports wrong shapes and unknown keys (with a "did you mean") at the
exact key or value, and never raises, so one pass collects every mistake.
``Expression`` and ``Reference`` are the two values every policy kind reads:
CEL source and a node name used as a link.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from policyd.cel.values import Duration
from policyd.policy.diagnostics import Diagnostic, did_you_mean
from policyd.policy.source import YMapping, YNode, YScalar, YSequence, kind_name

IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Fields:
    """One YAML mapping read field by field; problems go to ``diagnostics``."""

    def __init__(
        self,
        node: YMapping,
        known: Iterable[str],
        diagnostics: list[Diagnostic],
        *,
        what: str,
    ) -> None:
        self.node = node
        self.diagnostics = diagnostics
        known = tuple(known)
        for key, (key_node, _) in node.entries.items():
            if key not in known:
                self.error(key_node, f"unknown field '{key}' in {what}{did_you_mean(key, known)}")

    def error(self, node: YNode, message: str) -> None:
        self.diagnostics.append(node.source.diagnostic(node.at, message))

    def has(self, key: str) -> bool:
        return key in self.node.entries

    def key(self, key: str) -> YScalar | None:
        entry = self.node.entries.get(key)
        return entry[0] if entry else None

    def raw(self, key: str) -> YNode | None:
        entry = self.node.entries.get(key)
        return entry[1] if entry else None

    def mapping(self, key: str) -> YMapping | None:
        value = self.raw(key)
        if value is None or _is_null(value):
            return None
        if not isinstance(value, YMapping):
            self.error(value, f"'{key}' must be a mapping, not {kind_name(value)}")
            return None
        return value

    def sequence(self, key: str) -> YSequence | None:
        value = self.raw(key)
        if value is None or _is_null(value):
            return None
        if not isinstance(value, YSequence):
            self.error(value, f"'{key}' must be a list, not {kind_name(value)}")
            return None
        return value

    def string(self, key: str, *, required: bool = False) -> YScalar | None:
        """A non-empty string (a number written where text is expected is refused)."""
        value = self.raw(key)
        if value is None:
            if required:
                self.error(self.node, f"missing required field '{key}'")
            return None
        if not isinstance(value, YScalar) or not isinstance(value.value, str):
            self.error(value, f"'{key}' must be a string, not {kind_name(value)}")
            return None
        if not value.value.strip():
            self.error(value, f"'{key}' must not be empty")
            return None
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value = self.string(key)
        if value is None:
            return default
        text = str(value.value)
        if text not in choices:
            listed = ", ".join(choices)
            self.error(value, f"'{key}' must be one of {listed}, not '{text}'")
            return default
        return text

    def integer(self, key: str, *, minimum: int, default: int | None = None) -> int | None:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, YScalar) or not is_int(value.value):
            self.error(value, f"'{key}' must be an integer, not {kind_name(value)}")
            return default
        number = int(value.value)  # type: ignore[arg-type]
        if number < minimum:
            self.error(value, f"'{key}' must be at least {minimum}, not {number}")
            return default
        return number

    def number(self, key: str, *, default: float) -> float:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, YScalar) or not is_number(value.value):
            self.error(value, f"'{key}' must be a number, not {kind_name(value)}")
            return default
        return float(value.value)  # type: ignore[arg-type]


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def scalar_value(kind: str, value: object) -> tuple[object] | None:
    """``(value,)`` of a YAML scalar read as the CEL ``kind`` ``string``, ``int``,
    ``double``, ``bool`` or ``duration`` (written like ``250ms``), or None when it is
    not one: policy params and hand-written pods and requests read scalars alike."""
    if kind == "string" and isinstance(value, str):
        return (value,)
    if kind == "int" and is_int(value):
        return (value,)
    if kind == "double" and is_number(value):
        return (float(value),)  # type: ignore[arg-type]
    if kind == "bool" and isinstance(value, bool):
        return (value,)
    if kind == "duration" and isinstance(value, str):
        nanos = parse_duration(value)
        return None if nanos is None else (Duration(nanos),)
    return None


def _is_null(node: YNode) -> bool:
    return isinstance(node, YScalar) and node.value is None


def string_map(
    node: YMapping, diagnostics: list[Diagnostic], *, what: str
) -> tuple[tuple[str, str], ...]:
    """A mapping of names to string values (labels, header conditions)."""
    pairs: list[tuple[str, str]] = []
    for key, (_, value) in node.entries.items():
        if not isinstance(value, YScalar) or value.value is None or isinstance(value.value, bool):
            diagnostics.append(
                value.source.diagnostic(
                    value.at, f"{what} '{key}' must be a string, not {kind_name(value)}"
                )
            )
            continue
        pairs.append((key, str(value.value)))
    return tuple(pairs)


@dataclass(frozen=True, slots=True, eq=False)
class Expression:
    """CEL source as written in the file, able to place a CEL error in the file."""

    source: str
    node: YScalar

    def locate(self, line: int, column: int) -> tuple[int, int]:
        lines = self.source.split("\n")
        line = min(max(line, 1), len(lines))
        offset = sum(len(text) + 1 for text in lines[: line - 1]) + max(column, 1) - 1
        return self.node.locate(min(offset, max(len(self.source) - 1, 0)))


@dataclass(frozen=True, slots=True, eq=False)
class Reference:
    """A node name used as a link (``next``, ``on_success``, ``then`` ...)."""

    field: str
    name: str
    node: YScalar


def expression(fields: Fields, node: YNode, what: str) -> Expression | None:
    """The CEL expression written at ``node`` (a bare ``true`` or ``1`` counts too)."""
    if isinstance(node, YScalar) and isinstance(node.value, bool | int | float):
        return Expression(str(node.value).lower(), node)  # `keep: true`, `expr: 1`
    if not isinstance(node, YScalar) or not isinstance(node.value, str) or not node.value.strip():
        fields.error(node, f"{what} must be a CEL expression (a string), not {kind_name(node)}")
        return None
    return Expression(node.value, node)


def reference(fields: Fields, key: str) -> Reference | None:
    node = fields.string(key)
    return Reference(key, str(node.value), node) if node else None


def text(fields: Fields, key: str) -> str:
    node = fields.string(key)
    return str(node.value).strip() if node else ""


_DURATION: Final = re.compile(r"(\d+(?:\.\d+)?)(h|ms|us|µs|ns|m|s)")
_NANOS: Final = {
    "h": 3_600_000_000_000,
    "m": 60_000_000_000,
    "s": 1_000_000_000,
    "ms": 1_000_000,
    "us": 1_000,
    "µs": 1_000,
    "ns": 1,
}


def parse_duration(text: str) -> int | None:
    """Nanoseconds of a CEL duration string (``"1m30s"``, ``"-250ms"``), or None."""
    sign = -1 if text.startswith("-") else 1
    body = text.lstrip("-")
    parts = _DURATION.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        return None
    return sign * round(sum(float(number) * _NANOS[unit] for number, unit in parts))
