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
from typing import Any, Final

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


MAX_NODES: Final = 100_000  # values in one document, counting each use of an alias
# Collections inside collections. PyYAML composes recursively, so a deeper
# document would meet Python's recursion limit, which depends on the caller's
# stack; it is refused from the parser's events first, which need no recursion.
MAX_DEPTH: Final = 100


def parse_yaml(source: Source) -> tuple[YNode | None, list[Diagnostic]]:
    """The document's root node (None for an empty file) and any problems.

    Never raises on bad input: a character YAML does not allow (a NUL or
    other control byte, as in a file cut short or written as binary), bad
    syntax, a value its tag cannot hold (``!!int abc``), a recursive alias,
    nesting too deep or aliases that expand past ``MAX_NODES`` values all
    become a diagnostic at their place. Duplicate keys, which PyYAML would
    silently let the last one win, are an error here: in a policy they are
    almost always a copy-paste mistake.
    """
    try:
        loader = yaml.SafeLoader(source.text)
    except yaml.reader.ReaderError as error:  # checked up front over the whole text
        return None, [_unacceptable_character(source, error)]
    try:
        _refuse_deep_nesting(source.text)
        root = loader.get_single_node()
        if root is None:
            return None, []
        diagnostics: list[Diagnostic] = []
        return _Converter(source, loader, diagnostics).convert(root), diagnostics
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        at = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        problem = error.problem or error.context or "invalid YAML"
        return None, [source.diagnostic(at, f"invalid YAML: {problem}")]
    except yaml.reader.ReaderError as error:
        return None, [_unacceptable_character(source, error)]
    except yaml.YAMLError as error:
        return None, [source.diagnostic((1, 1), f"invalid YAML: {error}")]
    except _TooDeepError as error:
        message = f"invalid YAML: nested more than {MAX_DEPTH} levels deep"
        return None, [source.diagnostic(error.at, message)]
    except _TooManyNodesError as error:
        message = (
            f"invalid YAML: more than {MAX_NODES} values once aliases are expanded "
            "(aliases of aliases?)"
        )
        return None, [source.diagnostic(error.at, message)]
    finally:
        loader.dispose()


def _unacceptable_character(source: Source, error: yaml.reader.ReaderError) -> Diagnostic:
    """Where the character is and what it is: ``U+0000 (NUL)`` rather than ``#x0000``."""
    index = error.position if isinstance(error.position, int) else 0
    at = source.position(min(max(index, 0), len(source.text)))
    code = error.character if isinstance(error.character, int) else 0
    name = _CONTROL_NAMES.get(code, "")
    described = f"U+{code:04X}" + (f" ({name})" if name else "")
    hint = "; is the file complete, and text?" if code == 0 else ""
    return source.diagnostic(at, f"invalid YAML: character {described} is not allowed{hint}")


_CONTROL_NAMES: Final = {0: "NUL", 7: "BEL", 8: "backspace", 0x1B: "ESC", 0x7F: "DEL"}


def _refuse_deep_nesting(text: str) -> None:
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                mark = event.start_mark
                raise _TooDeepError((mark.line + 1, mark.column + 1) if mark else (1, 1))
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


class _TooDeepError(Exception):
    def __init__(self, at: tuple[int, int]) -> None:
        super().__init__(at)
        self.at = at


class _TooManyNodesError(Exception):
    def __init__(self, at: tuple[int, int]) -> None:
        super().__init__(at)
        self.at = at


class _Converter:
    """PyYAML nodes to ``YNode``s, counting values and refusing recursive aliases."""

    def __init__(
        self, source: Source, loader: yaml.SafeLoader, diagnostics: list[Diagnostic]
    ) -> None:
        self.source = source
        self.loader = loader
        self.diagnostics = diagnostics
        self.count = 0
        self.open: set[int] = set()  # ids of the collections being converted

    def convert(self, node: yaml.Node) -> YNode:
        source = self.source
        at = (node.start_mark.line + 1, node.start_mark.column + 1)
        self.count += 1
        if self.count > MAX_NODES:
            raise _TooManyNodesError(at)
        if id(node) in self.open:
            self.diagnostics.append(
                source.diagnostic(at, "invalid YAML: an alias used inside what it names")
            )
            return YScalar(source, at, None, None, node.start_mark.index, node.end_mark.index)
        if isinstance(node, yaml.MappingNode):
            self.open.add(id(node))
            entries: dict[str, tuple[YScalar, YNode]] = {}
            for key_node, value_node in node.value:
                key = self.convert(key_node)
                if not isinstance(key, YScalar) or not isinstance(key.value, str):
                    self.diagnostics.append(source.diagnostic(key.at, "keys must be plain names"))
                    continue
                if key.value in entries:
                    first = entries[key.value][0].at
                    self.diagnostics.append(
                        source.diagnostic(
                            key.at, f"duplicate key '{key.value}' (first at line {first[0]})"
                        )
                    )
                    continue
                entries[key.value] = (key, self.convert(value_node))
            self.open.discard(id(node))
            return YMapping(source, at, entries)
        if isinstance(node, yaml.SequenceNode):
            self.open.add(id(node))
            items = tuple(self.convert(item) for item in node.value)
            self.open.discard(id(node))
            return YSequence(source, at, items)
        assert isinstance(node, yaml.ScalarNode)
        return YScalar(
            source,
            at,
            self.scalar_value(node, at),
            node.style,
            node.start_mark.index,
            node.end_mark.index,
        )

    def scalar_value(self, node: yaml.ScalarNode, at: tuple[int, int]) -> Scalar:
        try:
            value: Any = self.loader.construct_object(node)
        except yaml.MarkedYAMLError as error:  # a tag SafeLoader refuses (!!python/...)
            problem = error.problem or "cannot read this value"
            self.diagnostics.append(self.source.diagnostic(at, f"invalid YAML: {problem}"))
            return None
        except (ValueError, TypeError, OverflowError) as error:  # !!int abc, !!timestamp 2020-13-45
            message = f"invalid YAML: cannot read this {node.tag.rpartition(':')[2]}: {error}"
            self.diagnostics.append(self.source.diagnostic(at, message))
            return None
        if value is None or isinstance(value, str | bool | int | float):
            return value
        return str(node.value)  # dates, binary, ...: keep the text as written
