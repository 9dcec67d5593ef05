"""Without the CEL conformance data, a fresh clone still passes and says why; CI fails.

The conformance data lives outside the repository. These tests run
``test_conformance.py`` in a child pytest with ``CEL_SPEC_TESTS`` naming an
empty folder: outside CI it must pass with every conformance test skipped and
the summary saying, once, that the conformance run did not happen; with ``CI=true`` it
must fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]


def run_conformance(empty: Path, *, ci: str | None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    environment["CEL_SPEC_TESTS"] = str(empty)
    if ci is not None:
        environment["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
         "tests/cel/test_conformance.py"],
        cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=240,
        check=False,
    )  # fmt: skip


def test_missing_data_outside_ci_skips_and_says_so_in_the_summary(tmp_path: Path) -> None:
    result = run_conformance(tmp_path, ci=None)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.split("short test summary info", 1)[-1].splitlines()
    skipped = [line for line in summary if line.startswith("SKIPPED")]
    assert len(skipped) == 1, summary  # one plain line, not one per test
    assert skipped[0].startswith(
        "SKIPPED [4] tests/cel/test_conformance.py: CEL conformance NOT RUN"
    )
    assert str(tmp_path) in skipped[0]
    assert "with CI=true this fails" in skipped[0]
    assert summary[-1].startswith("1 passed, 4 skipped")  # the test that needs no data ran


def test_missing_data_under_ci_fails(tmp_path: Path) -> None:
    result = run_conformance(tmp_path, ci="true")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "CEL conformance data missing" in result.stdout
    assert "CI=true, so this is a failure" in result.stdout
