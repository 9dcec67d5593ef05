"""The runnable example that opens docs/policy-language.md runs as shown."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from policyd.cli import main

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
