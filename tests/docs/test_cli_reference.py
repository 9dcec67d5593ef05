"""docs/cli.md documents every command and every flag the parser accepts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from policyd.cli import COMMANDS, build_parser

CLI_DOC = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()


def command_parser(name: str) -> argparse.ArgumentParser:
    parser = build_parser(name)
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    chosen: argparse.ArgumentParser = subparsers.choices[name]
    return chosen


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_of_the_command_is_documented(name: str) -> None:
    assert f"## `policyd {name}`" in CLI_DOC
    flags = [
        option
        for action in command_parser(name)._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
    ]
    assert flags or name in ("check", "test")
    missing = [flag for flag in flags if f"`{flag}" not in CLI_DOC]
    assert not missing, f"policyd {name}: not in docs/cli.md: {missing}"


def test_the_reference_names_no_flag_that_does_not_exist() -> None:
    known = {
        option
        for name in COMMANDS
        for action in command_parser(name)._actions
        for option in action.option_strings
    }
    documented = {
        word.strip("`").split()[0].rstrip(",")
        for word in CLI_DOC.split("`")
        if word.startswith("--") and not word.startswith("--- ")
    }
    assert documented - known == set()
