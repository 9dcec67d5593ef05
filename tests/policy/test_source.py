"""Positions inside YAML scalars: where a character of a value was written."""

from __future__ import annotations

import pytest

from policyd.policy.source import Source, YMapping, YScalar, parse_yaml


def scalar(text: str) -> YScalar:
    root, diagnostics = parse_yaml(Source("f.yaml", text))
    assert diagnostics == [] and isinstance(root, YMapping)
    value = root.entries["k"][1]
    assert isinstance(value, YScalar)
    return value


@pytest.mark.parametrize(
    ("text", "target", "position"),
    [
        ("k: pod.x < 3\n", "x", (1, 8)),
        ("k: a &&\n  pod.x\n", "x", (2, 7)),  # plain, folded onto one line
        ("k: 'a == ''it''s'' || pod.x'\n", "x", (1, 27)),  # '' is one quote in the value
        ('k: "\\"a\\" == pod.x"\n', "x", (1, 18)),  # escaped quotes
        ("k: |\n  a &&\n    pod.x\n", "x", (3, 9)),  # literal block keeps indentation
        ("k: >-\n  a &&\n  pod.x\n", "x", (3, 7)),  # folded block
    ],
)
def test_a_value_offset_maps_to_the_character_in_the_file(
    text: str, target: str, position: tuple[int, int]
) -> None:
    node = scalar(text)
    offset = str(node.value).rindex(target)
    assert node.locate(offset) == position
    line, column = position
    assert text.splitlines()[line - 1][column - 1] == target


def test_duplicate_keys_are_reported_not_silently_overwritten() -> None:
    _, diagnostics = parse_yaml(Source("f.yaml", "a: 1\nb: 2\na: 3\n"))
    assert [str(d) for d in diagnostics] == ["f.yaml:3:1: duplicate key 'a' (first at line 1)"]
