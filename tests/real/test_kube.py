"""The documented cluster commands take the telemetry files, against a real API server.

``docs/observability.md`` has ``kubectl apply -f telemetry/jaeger.yaml``,
``istioctl install -f telemetry/istio-mesh-tracing.yaml`` and ``kubectl apply
-f telemetry/istio-telemetry.yaml``. Here the real kube-apiserver (on etcd,
``kube_cluster.py``) checks every object of the kubectl files with a
server-side dry run and strict field validation (Istio's CRDs, from
``istioctl manifest generate``, installed first), and the real ``istioctl
install --dry-run`` runs against it.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_cluster import Cluster, start_cluster, stop_cluster

ASSETS = Path(__file__).resolve().parents[2] / "telemetry"


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="module")
def cluster(
    tool: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    binaries = tool("etcd"), tool("kube-apiserver"), tool("openssl")
    running = start_cluster(*binaries, tmp_path_factory.mktemp("cluster"))
    try:
        yield running
    finally:
        stop_cluster(running)


@pytest.fixture(scope="module")
def istio_crds(cluster: Cluster, tool: Callable[[str], str]) -> None:
    """Istio's CRDs (Telemetry among them), as istioctl would install them, and istio-system."""
    rendered = subprocess.run(
        [tool("istioctl"), "manifest", "generate"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    crds = [d for d in documents(rendered.stdout) if d["kind"] == "CustomResourceDefinition"]
    assert crds
    for crd in crds:
        status, message = cluster.apply(crd, dry_run=False)
        assert status in (200, 201), message
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "istio-system"}}
    status, message = cluster.apply(namespace, dry_run=False)
    assert status in (200, 201), message
    # A new CRD's resources are served a moment after it is created.
    (telemetry,) = documents((ASSETS / "istio-telemetry.yaml").read_text())
    for _ in range(100):
        if cluster.apply(telemetry, dry_run=True)[0] != 404:
            return
        time.sleep(0.2)


def server_dry_run(cluster: Cluster, name: str) -> list[tuple[str, int, str]]:
    """``kubectl apply --server-side --dry-run=server -f telemetry/NAME``, object by object
    (a Namespace is created for real, as the objects in it need it)."""
    results = []
    for document in documents((ASSETS / name).read_text()):
        status, message = cluster.apply(document, dry_run=document["kind"] != "Namespace")
        results.append((f"{document['kind']}/{document['metadata']['name']}", status, message))
    return results


def test_the_api_server_accepts_every_object_of_jaeger_yaml(cluster: Cluster) -> None:
    results = server_dry_run(cluster, "jaeger.yaml")
    assert [r[0] for r in results] == [
        "Namespace/observability",
        "ConfigMap/jaeger-config",
        "Deployment/jaeger",
        "Service/jaeger-collector",
        "Service/jaeger-query",
    ]
    assert all(status in (200, 201) for _, status, _ in results), results


def test_the_api_server_accepts_the_telemetry_resource(cluster: Cluster, istio_crds: None) -> None:
    results = server_dry_run(cluster, "istio-telemetry.yaml")
    assert [(r[0], r[1]) for r in results] == [("Telemetry/mesh-default", 201)], results


def test_the_strict_dry_run_would_catch_a_misspelt_field(
    cluster: Cluster, istio_crds: None
) -> None:
    """The two checks above are not vacuous."""
    (telemetry,) = documents((ASSETS / "istio-telemetry.yaml").read_text())
    telemetry["spec"]["tracing"][0]["provider"] = telemetry["spec"]["tracing"][0].pop("providers")
    status, message = cluster.apply(telemetry, dry_run=True)
    assert status >= 400 and "field not declared in schema" in message


def test_istioctl_install_dry_run_takes_the_install_file(
    cluster: Cluster, tool: Callable[[str], str]
) -> None:
    installed = subprocess.run(
        [
            tool("istioctl"),
            f"--kubeconfig={cluster.kubeconfig}",
            "install",
            "-f",
            str(ASSETS / "istio-mesh-tracing.yaml"),
            "--dry-run",
            "-y",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "Installation complete" in installed.stdout + installed.stderr
