"""Positions inside YAML scalars: where a character of a value was written."""

from __future__ import annotations

import pytest

from policyd.policy.source import MAX_NODES, Source, YMapping, YScalar, parse_yaml


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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "a: 1\nb: \x00\n",
            "f.yaml:2:4: invalid YAML: character U+0000 (NUL) is not allowed; "
            "is the file complete, and text?",
        ),
        ("a: \x07", "f.yaml:1:4: invalid YAML: character U+0007 (BEL) is not allowed"),
        (
            "a: !!int abc\n",
            "f.yaml:1:4: invalid YAML: cannot read this int: "
            "invalid literal for int() with base 10: 'abc'",
        ),
        (
            "a: !!timestamp 2020-13-45\n",
            "f.yaml:1:4: invalid YAML: cannot read this timestamp: month must be in 1..12",
        ),
        (
            "a: !!python/object:os.system x\n",
            "f.yaml:1:4: invalid YAML: could not determine a "
            "constructor for the tag 'tag:yaml.org,2002:python/object:os.system'",
        ),
        ("a: &x [1, *x]\n", "f.yaml:1:4: invalid YAML: an alias used inside what it names"),
        ("a: &x {b: *x}\n", "f.yaml:1:4: invalid YAML: an alias used inside what it names"),
        (
            "a: " + "[" * 5000 + "]" * 5000,
            "f.yaml:1:103: invalid YAML: nested more than 100 levels deep",
        ),
        (  # the root mapping and 99 lists are 100 levels; a mapping and 99 lists inside one, 101
            "a: " + "[" * 99 + "]" * 99 + "\nb: {c: " + "[" * 99 + "]" * 99 + "}",
            "f.yaml:2:106: invalid YAML: nested more than 100 levels deep",
        ),
    ],
)
def test_what_yaml_cannot_read_is_a_diagnostic_never_an_exception(text: str, expected: str) -> None:
    _, diagnostics = parse_yaml(Source("f.yaml", text))
    assert [str(d) for d in diagnostics] == [expected]


def test_aliases_that_expand_without_bound_are_refused_quickly() -> None:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    root, diagnostics = parse_yaml(Source("f.yaml", "\n".join(lines)))  # 10^9 values
    assert root is None
    (diagnostic,) = diagnostics
    assert diagnostic.message == (
        f"invalid YAML: more than {MAX_NODES} values once aliases are expanded "
        "(aliases of aliases?)"
    )
