"""The ``policyd check`` commands docs/cli.md shows succeed on the repository's files.

Each ``$ policyd check ...`` line of the page whose paths exist here (globs
expanded as a shell would) is run from the repository root and must exit 0.
"""

from __future__ import annotations

import glob
import shlex
from pathlib import Path

import pytest

from policyd.cli import main

REPO = Path(__file__).resolve().parents[2]
CLI_DOC = (REPO / "docs" / "cli.md").read_text()


def check_commands() -> list[list[str]]:
    commands = []
    for line in CLI_DOC.splitlines():
        if not line.startswith("$ policyd check "):
            continue
        words = shlex.split(line.removeprefix("$ policyd ").split("#", 1)[0])
        expanded = [
            word
            for pattern in words
            for word in (sorted(glob.glob(pattern, root_dir=REPO)) if "*" in pattern else [pattern])
        ]
        paths = [word for word in expanded[1:] if not word.startswith("-")]
        if paths and all((REPO / path).exists() for path in paths):
            commands.append(expanded)
    return commands


def test_the_page_shows_the_check_of_the_shipped_rules() -> None:
    assert ["check", "rules/default.yaml"] in check_commands()
    assert any(len(c) > 3 and all(w.startswith("rules/") for w in c[1:]) for c in check_commands())


@pytest.mark.parametrize("command", check_commands(), ids=" ".join)
def test_a_documented_check_command_exits_0(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    code = main(command)
    assert code == 0, capsys.readouterr().out
