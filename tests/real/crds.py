"""The real CRDs of the Gateway API and its Inference Extension, from the Go module cache.

The projects publish their CRDs in their Go modules (``config/crd``); the
tests read them from ``go env GOMODCACHE``, running ``go mod download`` for
a version not cached yet (``GOFLAGS=-mod=mod``: no go.mod is needed). Without
``go``, or without the module (no module proxy), a test that needs them is
skipped, saying which, as the other real tools are.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

# The newest releases the Go module proxy serves to this toolchain (go 1.26):
# gateway-api v1.7.0 needs go 1.27.
INFERENCE_EXTENSION = ("sigs.k8s.io/gateway-api-inference-extension", "v1.6.0")
GATEWAY_API = ("sigs.k8s.io/gateway-api", "v1.6.3")


def module_dir(module: str, version: str) -> Path:
    """The module's directory in the Go module cache; skips the test when it cannot be had."""
    go = shutil.which("go")
    if go is None:
        pytest.skip(f"go is not on PATH: {module}@{version}'s CRDs cannot be read (install Go)")
    cache = subprocess.run(
        [go, "env", "GOMODCACHE"], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    escaped = "".join(f"!{c.lower()}" if c.isupper() else c for c in module)
    directory = Path(cache) / f"{escaped}@{version}"
    if directory.is_dir():
        return directory
    downloaded = subprocess.run(
        [go, "mod", "download", "-json", f"{module}@{version}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "GOFLAGS": "-mod=mod"},
    )
    answer = json.loads(downloaded.stdout or "{}")
    if downloaded.returncode != 0 or "Dir" not in answer:
        reason = answer.get("Error") or downloaded.stderr.strip()
        pytest.skip(f"go mod download {module}@{version} failed: {reason}")
    return Path(answer["Dir"])


def _crds(folder: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(folder.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document and document.get("kind") == "CustomResourceDefinition":
                found.append(document)
    assert found, f"no CRD in {folder}"
    return found


def inference_extension_crds() -> list[dict[str, Any]]:
    """InferencePool (inference.networking.k8s.io/v1) and the extension's alpha CRDs."""
    return _crds(module_dir(*INFERENCE_EXTENSION) / "config" / "crd" / "bases")


def gateway_api_crds() -> list[dict[str, Any]]:
    """The standard channel: Gateway, GatewayClass, HTTPRoute, GRPCRoute, ReferenceGrant, ..."""
    return _crds(module_dir(*GATEWAY_API) / "config" / "crd" / "standard")
