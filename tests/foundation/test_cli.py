"""The command line entry point: version and help (each command has its own tests)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from policyd import __version__
from policyd.cli import main


def test_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"policyd {__version__}"


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_the_module_runs_as_a_separate_process() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "policyd", "--version"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"policyd {__version__}"
