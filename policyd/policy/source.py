"""YAML that remembers where every value was written.

PyYAML's composer gives nodes with marks; this module turns them into small
typed nodes (``YMapping``, ``YSequence``, ``YScalar``) carrying their 1-based
line and column, so every later check can say ``file:line:col``. A scalar can
also map an offset *inside its value* back to the file, which is how the
column of a CEL error inside ``keep: pod.waiting_qeue < 3`` (or inside a
multi-line block) lands on the right character of the file.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import yaml

from policyd.policy.diagnostics import Diagnostic

Scalar = str | int | float | bool | None


@dataclass(frozen=True, slots=True)
class Source:
    """A file's text and where its lines start, to turn offsets into positions."""

    path: str
    text: str
    line_starts: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        starts = [0] + [i + 1 for i, char in enumerate(self.text) if char == "\n"]
        object.__setattr__(self, "line_starts", tuple(starts))

    def position(self, index: int) -> tuple[int, int]:
        """1-based (line, column) of a character offset."""
        line = bisect.bisect_right(self.line_starts, index) - 1
        return line + 1, index - self.line_starts[line] + 1

    def diagnostic(self, at: tuple[int, int], message: str, *, warning: bool = False) -> Diagnostic:
        return Diagnostic(self.path, at[0], at[1], message, "warning" if warning else "error")


@dataclass(frozen=True, slots=True, eq=False)
class YNode:
    source: Source
    at: tuple[int, int]  # 1-based (line, column) where the node starts


@dataclass(frozen=True, slots=True, eq=False)
class YScalar(YNode):
    value: Scalar
    style: str | None  # None (plain), '"', "'", '|', '>'
    start: int  # offset of the node's first character in the file
    end: int

    def locate(self, offset: int) -> tuple[int, int]:
        """File position of character ``offset`` of the (string) value.

        The value is the raw text with quotes, indentation, escapes and line
        folding taken out, so it is (nearly) a subsequence of the raw text: a
        greedy forward match recovers where each character came from, a space
        standing for a folded line break. If the match runs off (an exotic
        escape), the scalar's own start is the answer.
        """
        text = str(self.value)
        raw = self.source.text
        index = self.start
        if self.style in ('"', "'"):
            index += 1
        elif self.style in ("|", ">"):
            index = raw.index("\n", index) + 1
        for position, char in enumerate(text[: offset + 1]):
            while index < self.end and not _same(raw[index], char):
                index += 1
            if index >= self.end:
                return self.at
            if position == offset:
                return self.source.position(index)
            index += 1
        return self.source.position(min(index, max(self.end - 1, self.start)))


def _same(raw: str, value: str) -> bool:
    return raw == value or (value == " " and raw == "\n")


@dataclass(frozen=True, slots=True, eq=False)
class YSequence(YNode):
    items: tuple[YNode, ...]


@dataclass(frozen=True, slots=True, eq=False)
class YMapping(YNode):
    # key -> (the key's own node, the value node), in file order
    entries: dict[str, tuple[YScalar, YNode]]


def kind_name(node: YNode) -> str:
    """How a message names what was found ("a list", "a number", ...)."""
    if isinstance(node, YMapping):
        return "a mapping"
    if isinstance(node, YSequence):
        return "a list"
    assert isinstance(node, YScalar)
    value = node.value
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "a number"
    return "a string"


def parse_yaml(source: Source) -> tuple[YNode | None, list[Diagnostic]]:
    """The document's root node (None for an empty file) and any problems.

    Duplicate keys, which PyYAML would silently let the last one win, are an
    error here: in a policy they are almost always a copy-paste mistake.
    """
    loader = yaml.SafeLoader(source.text)
    try:
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        at = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        problem = error.problem or error.context or "invalid YAML"
        return None, [source.diagnostic(at, f"invalid YAML: {problem}")]
    except yaml.YAMLError as error:
        return None, [source.diagnostic((1, 1), f"invalid YAML: {error}")]
    finally:
        loader.dispose()
    if root is None:
        return None, []
    diagnostics: list[Diagnostic] = []
    return _convert(root, source, loader, diagnostics), diagnostics


def _convert(
    node: yaml.Node, source: Source, loader: yaml.SafeLoader, diagnostics: list[Diagnostic]
) -> YNode:
    at = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        entries: dict[str, tuple[YScalar, YNode]] = {}
        for key_node, value_node in node.value:
            key = _convert(key_node, source, loader, diagnostics)
            if not isinstance(key, YScalar) or not isinstance(key.value, str):
                diagnostics.append(source.diagnostic(key.at, "keys must be plain names"))
                continue
            if key.value in entries:
                first = entries[key.value][0].at
                diagnostics.append(
                    source.diagnostic(
                        key.at, f"duplicate key '{key.value}' (first at line {first[0]})"
                    )
                )
                continue
            entries[key.value] = (key, _convert(value_node, source, loader, diagnostics))
        return YMapping(source, at, entries)
    if isinstance(node, yaml.SequenceNode):
        items = tuple(_convert(item, source, loader, diagnostics) for item in node.value)
        return YSequence(source, at, items)
    assert isinstance(node, yaml.ScalarNode)
    return YScalar(
        source,
        at,
        _scalar_value(node, loader),
        node.style,
        node.start_mark.index,
        node.end_mark.index,
    )


def _scalar_value(node: yaml.ScalarNode, loader: yaml.SafeLoader) -> Scalar:
    value: Any = loader.construct_object(node)
    if value is None or isinstance(value, str | bool | int | float):
        return value
    return str(node.value)  # dates, binary, ...: keep the text as written
