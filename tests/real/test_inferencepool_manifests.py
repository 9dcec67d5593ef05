"""The manifests of istio/inferencepool/ with the real kustomize, istioctl and API server.

- ``kustomize build istio/inferencepool`` builds, with the namespace and the
  image set on every object;
- every object passes a server-side dry run with strict field validation on
  the real kube-apiserver with the real CRDs installed (Gateway API v1.6.3
  standard channel, Gateway API Inference Extension v1.6.0: ``crds.py``),
  which checks them against the CRDs' schemas and CEL rules;
- ``istioctl validate`` and ``istioctl analyze`` find nothing wrong. They do
  not check Gateway API or InferencePool objects (a broken HTTPRoute passes
  both, shown below): for those the dry run is the check.
"""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from crds import gateway_api_crds, inference_extension_crds
from kube_cluster import Cluster, start_cluster, stop_cluster

MANIFESTS = Path(__file__).resolve().parents[2] / "istio" / "inferencepool"
KUSTOMIZATION = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
NAMESPACE = KUSTOMIZATION["namespace"]
FILES = [MANIFESTS / name for name in KUSTOMIZATION["resources"]]


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def objects() -> list[dict[str, Any]]:
    """Every object of the kustomization's files, as written."""
    return [d for path in FILES for d in documents(path.read_text())]


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


# --- kustomize -----------------------------------------------------------------------


def test_kustomize_builds_every_object_into_the_namespace(tool: Callable[[str], str]) -> None:
    built = run(tool("kustomize"), "build", str(MANIFESTS))
    assert built.returncode == 0, built.stderr
    result = documents(built.stdout)
    names = {(d["kind"], d["metadata"]["name"]) for d in result}
    assert names == {(d["kind"], d["metadata"]["name"]) for d in objects()}
    assert {"InferencePool", "HTTPRoute", "Gateway", "Deployment", "Role"} <= {k for k, _ in names}
    assert all(d["metadata"]["namespace"] == NAMESPACE for d in result)
    (image,) = KUSTOMIZATION["images"]
    (deployment,) = [d for d in result if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{image['newName']}:{image['newTag']}"
    (binding,) = [d for d in result if d["kind"] == "RoleBinding"]
    assert binding["subjects"][0]["namespace"] == NAMESPACE


# --- istioctl ------------------------------------------------------------------------


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_istioctl_validates_each_file(tool: Callable[[str], str], path: Path) -> None:
    validated = run(tool("istioctl"), "validate", "-f", str(path))
    assert validated.returncode == 0, validated.stdout + validated.stderr
    said = validated.stdout + validated.stderr
    if "has warnings" in said:  # istioctl warns on every EnvoyFilter; nothing else may warn
        assert _only_envoyfilter_warnings(said), said
    else:
        assert "is valid" in said


def test_istioctl_analyze_finds_nothing_wrong(tool: Callable[[str], str]) -> None:
    analyzed = run(tool("istioctl"), "analyze", "--use-kube=false", *map(str, FILES))
    assert analyzed.returncode == 0, analyzed.stdout + analyzed.stderr
    said = (analyzed.stdout + analyzed.stderr).strip()
    issues = [line for line in said.splitlines() if line.startswith(("Error", "Warning", "Info"))]
    # IST0133 is what istioctl says of every EnvoyFilter (internal API); nothing else may come.
    assert issues or "No validation issues found" in said, said
    assert all(line.startswith("Warning [IST0133] (EnvoyFilter ") for line in issues), said


def _only_envoyfilter_warnings(said: str) -> bool:
    """Whether every warning ``istioctl validate`` printed is its note on EnvoyFilters."""
    warnings = [line.strip() for line in said.splitlines() if line.strip().startswith("*")]
    return bool(warnings) and all(
        "EnvoyFilter exposes internal implementation details" in line for line in warnings
    )


def test_istioctl_does_not_check_gateway_api_objects(
    tool: Callable[[str], str], tmp_path: Path
) -> None:
    """What the two checks above cannot see; the strict dry run below does."""
    bad = tmp_path / "httproute.yaml"
    bad.write_text((MANIFESTS / "httproute.yaml").read_text().replace("PathPrefix", "PathPrefx"))
    assert run(tool("istioctl"), "validate", "-f", str(bad)).returncode == 0
    assert run(tool("istioctl"), "analyze", "--use-kube=false", str(bad)).returncode == 0


# --- strict server-side dry run ------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(
    tool: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    binaries = tool("etcd"), tool("kube-apiserver"), tool("openssl")
    # Istio's CRDs for the DestinationRule (TLS to policyd), as test_helm.py gets them.
    generated = subprocess.run(
        [tool("istioctl"), "manifest", "generate"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    istio_crds = [d for d in documents(generated.stdout) if d["kind"] == "CustomResourceDefinition"]
    assert istio_crds
    crds = [*istio_crds, *gateway_api_crds(), *inference_extension_crds()]
    running = start_cluster(*binaries, tmp_path_factory.mktemp("cluster"))
    try:
        for crd in crds:
            status, message = running.apply(crd, dry_run=False)
            assert status in (200, 201), message
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        status, message = running.apply(namespace, dry_run=False)
        assert status in (200, 201), message
        yield running
    finally:
        stop_cluster(running)


def test_the_api_server_accepts_every_object(cluster: Cluster) -> None:
    results = []
    for document in objects():
        status, message = cluster.create_when_served(document, NAMESPACE)
        results.append((f"{document['kind']}/{document['metadata']['name']}", status, message))
    assert len(results) == len(objects())
    assert all(status == 201 for _, status, _ in results), results


@pytest.mark.parametrize(
    ("kind", "change", "complaint"),
    [
        (
            "InferencePool",
            lambda o: o["spec"].update(targetPort=o["spec"].pop("targetPorts")),
            "unknown field",
        ),
        (
            "InferencePool",
            lambda o: o["spec"]["endpointPickerRef"].pop("port"),
            "port is required when kind is 'Service'",
        ),
        (
            "HTTPRoute",
            lambda o: o["spec"]["rules"][0]["matches"][0]["path"].update(type="PathPrefx"),
            "Unsupported value",
        ),
        (
            "Gateway",
            lambda o: o["spec"]["listeners"][0].update(protocl="HTTP"),
            "unknown field",
        ),
    ],
)
def test_the_strict_dry_run_would_catch_a_mistake(
    cluster: Cluster, kind: str, change: Callable[[dict[str, Any]], object], complaint: str
) -> None:
    """The dry run above is not vacuous for the Gateway API and InferencePool kinds."""
    (document,) = [copy.deepcopy(d) for d in objects() if d["kind"] == kind]
    change(document)
    status, message = cluster.create_when_served(document, NAMESPACE)
    assert status >= 400, (kind, status, message)
    assert complaint in message or "not declared in schema" in message, message
