"""The real ``istioctl`` takes the Istio telemetry files as the docs use them.

``istioctl install`` cannot run without a cluster (even ``--dry-run`` asks the
API server for its version), but it renders its input exactly as
``istioctl manifest generate`` does (``render.GenerateManifest``), which needs
none: that is what runs here. The Telemetry resource, applied with kubectl,
goes through ``istioctl validate`` and ``istioctl analyze`` on files.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

ASSETS = Path(__file__).resolve().parents[2] / "telemetry"
OPERATOR = ASSETS / "istio-mesh-tracing.yaml"
TELEMETRY = ASSETS / "istio-telemetry.yaml"


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def test_istioctl_renders_the_install_file_with_the_tracing_provider(
    tool: Callable[[str], str],
) -> None:
    rendered = run(tool("istioctl"), "manifest", "generate", "-f", str(OPERATOR))
    assert rendered.returncode == 0, rendered.stderr
    config_maps = [
        d
        for d in yaml.safe_load_all(rendered.stdout)
        if d and d.get("kind") == "ConfigMap" and d["metadata"]["name"] == "istio"
    ]
    (mesh_config,) = config_maps
    mesh = yaml.safe_load(mesh_config["data"]["mesh"])
    (operator,) = yaml.safe_load_all(OPERATOR.read_text())
    assert mesh["enableTracing"] is True
    providers = {p["name"]: p for p in mesh["extensionProviders"]}
    (wanted,) = operator["spec"]["meshConfig"]["extensionProviders"]
    assert providers[wanted["name"]]["opentelemetry"] == wanted["opentelemetry"]


def test_istioctl_refuses_the_two_files_as_one(tool: Callable[[str], str], tmp_path: Path) -> None:
    """What the file held before it was split, which is why it was."""
    both = tmp_path / "both.yaml"
    both.write_text(OPERATOR.read_text() + "---\n" + TELEMETRY.read_text())
    rendered = run(tool("istioctl"), "manifest", "generate", "-f", str(both))
    assert rendered.returncode != 0
    assert "contains multiple IstioOperator CRs" in rendered.stderr


@pytest.mark.parametrize("path", [OPERATOR, TELEMETRY], ids=lambda p: p.name)
def test_istioctl_validates_each_file(tool: Callable[[str], str], path: Path) -> None:
    validated = run(tool("istioctl"), "validate", "-f", str(path))
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "is valid" in validated.stdout + validated.stderr


def test_istioctl_validate_would_catch_a_bad_telemetry_resource(
    tool: Callable[[str], str], tmp_path: Path
) -> None:
    """The check above is not vacuous: a percentage out of range fails it."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(TELEMETRY.read_text().replace("Percentage: 100", "Percentage: 200"))
    validated = run(tool("istioctl"), "validate", "-f", str(bad))
    assert validated.returncode != 0
    assert "randomSamplingPercentage" in validated.stderr


@pytest.mark.parametrize("path", [OPERATOR, TELEMETRY], ids=lambda p: p.name)
def test_istioctl_analyze_finds_nothing_wrong(tool: Callable[[str], str], path: Path) -> None:
    analyzed = run(tool("istioctl"), "analyze", "--use-kube=false", str(path))
    assert analyzed.returncode == 0, analyzed.stdout + analyzed.stderr
    assert "No validation issues found" in analyzed.stdout + analyzed.stderr
