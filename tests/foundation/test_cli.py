"""The command line entry point: version and help (each command has its own tests)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from policyd import __version__
from policyd.cli import main

REPO = Path(__file__).resolve().parents[2]


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


def _piped_to_head(argv: list[str]) -> tuple[int, str, bytes]:
    """Run ``policyd ARGV | head -n 1``: the exit status, stderr and what head printed."""
    writer = subprocess.Popen(
        [sys.executable, "-m", "policyd", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert writer.stdout is not None and writer.stderr is not None
    reader = subprocess.Popen(["head", "-n", "1"], stdin=writer.stdout, stdout=subprocess.PIPE)
    writer.stdout.close()  # head holds the only read end: when it exits, the pipe is closed
    printed, _ = reader.communicate(timeout=120)
    stderr = writer.stderr.read().decode()
    writer.stderr.close()
    return writer.wait(timeout=120), stderr, printed


@pytest.mark.parametrize("command", ["explain", "test"])
def test_output_piped_to_a_reader_that_leaves_early_ends_quietly(
    command: str, tmp_path: Path
) -> None:
    """Several times what a pipe holds (64 KiB), so writing goes on after head has gone."""
    if command == "explain":  # the walk as JSON names every pod at every node: ~1 MB
        pods = {f"pod-{i}": {"address": f"10.0.{i // 250}.{i % 250}:8000"} for i in range(3000)}
        (tmp_path / "pods.json").write_text(json.dumps(pods))
        (tmp_path / "request.json").write_text('{"model": "m"}')
        argv = ["explain", "--json", "--policy", str(REPO / "rules" / "default.yaml")]
        argv += ["--pods", str(tmp_path / "pods.json"), "--request", str(tmp_path / "request.json")]
        first = b"{"
    else:  # one PASS line per case: ~300 KB
        cases = {
            f"case {i}": {"request": {"model": "m"}, "expect": {"outcome": "routed"}}
            for i in range(3000)
        }
        tests = tmp_path / "random.test.yaml"
        policy = REPO / "rules" / "random.yaml"
        tests.write_text(json.dumps({"policy": str(policy), "pods": {"a": {}}, "cases": cases}))
        argv = ["test", "-v", str(tests)]
        first = f"{tests}: PASS case 0".encode()
    status, stderr, printed = _piped_to_head(argv)
    assert printed.startswith(first)
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
    assert status == 128 + signal.SIGPIPE
