"""docs/policy-language.md: the opening example runs as shown; the schema tables are
the declared fields (``policyd.fields``), row for row: name, type and meaning."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from policyd.cli import main
from policyd.fields import POD_FIELDS, REQUEST_FIELDS, Field

from .helpers import REPO

DOC = REPO / "docs" / "policy-language.md"


def blocks(kind: str) -> list[str]:
    first_section = DOC.read_text().split("\n## ", 2)[1]  # the opening example only
    return re.findall(rf"```{kind}\n(.*?)```", first_section, flags=re.DOTALL)


def test_the_opening_example_checks_explains_and_tests_as_documented(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    policy, tests = blocks("yaml")
    pods, request = blocks("json")
    check_run, explain_run, test_run = blocks("console")
    monkeypatch.chdir(tmp_path)
    Path("least-loaded.yaml").write_text(policy)
    Path("least-loaded.test.yaml").write_text(tests)
    Path("pods.json").write_text(pods)
    Path("request.json").write_text(request)
    for run in (check_run, explain_run, test_run):
        command, expected = run.split("\n", 1)
        arguments = command.removeprefix("$ policyd ").split()
        assert main(arguments) == 0
        assert capsys.readouterr().out == expected, command


def schema_table(heading: str) -> list[tuple[str, str, str]]:
    """(field, type, meaning) rows of the table after ``heading`` in "What expressions see"."""
    section = DOC.read_text().split("\n## What expressions see\n", 1)[1].split("\n## ", 1)[0]
    table = section.split(f"\n{heading}\n", 1)[1].strip().split("\n\n", 1)[0]
    rows = [line.split("|")[1:4] for line in table.splitlines()[2:]]
    return [
        (name.strip().strip("`"), kind.strip(), meaning.strip()) for name, kind, meaning in rows
    ]


@pytest.mark.parametrize(
    ("heading", "fields"), [("`pod` (one candidate):", POD_FIELDS), ("`request`:", REQUEST_FIELDS)]
)
def test_the_documented_schema_is_the_schema_policies_are_checked_against(
    heading: str, fields: tuple[Field, ...]
) -> None:
    declared = [
        (f.name, f.kind.replace("<", "(").replace(">", ")").replace(",", ", "), f.doc)
        for f in fields
    ]
    assert schema_table(heading) == declared
