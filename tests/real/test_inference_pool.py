"""InferencePool discovery against the real kube-apiserver, with the real CRD and RBAC.

The API server of ``kube_cluster.py`` (etcd behind it, no kubelet: pods are
created and their status written as a kubelet would) serves the
InferencePool CRD of the Gateway API Inference Extension's Go module
(``crds.py``). policyd's discovery runs with the token of a ServiceAccount
bound to the Role of ``istio/inferencepool/rbac.yaml``: ``get`` and
``watch`` on the one pool, ``list`` and ``watch`` on pods. Anything more it
asked for would be refused, so these tests also show the Role is enough.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from crds import inference_extension_crds
from kube_cluster import Cluster, start_cluster, stop_cluster
from model_server import MetricsServer, vllm_text

from policyd.pool import DiscoveryError, PodIdentity, Pool, ScrapeConfig
from policyd.pool.kubernetes_discovery import KubernetesDiscovery, KubernetesOptions

# The test API server's certificate is self-signed (the kubeconfig skips verification).
pytestmark = pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")

MANIFESTS = Path(__file__).resolve().parents[2] / "istio" / "inferencepool"
NAMESPACE = "inference"
POOLS = f"/apis/inference.networking.k8s.io/v1/namespaces/{NAMESPACE}/inferencepools"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"


def manifest(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


POOL_NAME = manifest("inferencepool.yaml")[0]["metadata"]["name"]


@pytest.fixture(scope="module")
def cluster(
    tool: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    binaries = tool("etcd"), tool("kube-apiserver"), tool("openssl")
    running = start_cluster(*binaries, tmp_path_factory.mktemp("cluster"))
    try:
        for document in (
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            # no controller manager creates it, and pods cannot be created without it
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": "default", "namespace": NAMESPACE},
            },
        ):
            status, message = running.apply(document, dry_run=False)
            assert status in (200, 201), message
        yield running
    finally:
        stop_cluster(running)


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    for crd in inference_extension_crds():
        status, message = cluster.apply(crd, dry_run=False)
        assert status in (200, 201), message
    for _ in range(100):  # a new CRD's resources are served a moment after it is created
        if cluster.call("GET", POOLS)[0] == 200:
            return
        time.sleep(0.2)
    raise AssertionError("the InferencePool resource is not served")


@pytest.fixture(scope="module")
def policyd_kubeconfig(
    cluster: Cluster, crds: None, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A kubeconfig with the token of the ServiceAccount of istio/inferencepool/."""
    for name in ("serviceaccount.yaml", "rbac.yaml"):
        for document in manifest(name):
            document["metadata"]["namespace"] = NAMESPACE
            for subject in document.get("subjects", ()):
                subject["namespace"] = NAMESPACE  # what kustomize's namespace: adds
            status, message = cluster.apply(document, dry_run=False)
            assert status in (200, 201), message
    token = cluster.service_account_token(NAMESPACE, "policyd")
    return cluster.kubeconfig_for(token, tmp_path_factory.mktemp("policyd") / "kubeconfig")


def put_pod(
    cluster: Cluster, name: str, ip: str | None, *, ready: bool = True, **labels: str
) -> None:
    """A pod as the scheduler and kubelet would leave it: created, then its status written."""
    status, answer = cluster.call("GET", f"{PODS}/{name}")
    if status == 404:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels or {"app": "vllm"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        }
        status, answer = cluster.call("POST", PODS, pod)
        assert status == 201, answer
    pod_status: dict[str, Any] = {
        "phase": "Running" if ip else "Pending",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip:
        pod_status.update(podIP=ip, podIPs=[{"ip": ip}])
    status, answer = cluster.call(
        "PATCH",
        f"{PODS}/{name}/status",
        {"status": pod_status},
        content_type="application/merge-patch+json",
    )
    assert status == 200, answer


def put_pool(cluster: Cluster, ports: list[int], **labels: str) -> None:
    (pool,) = manifest("inferencepool.yaml")
    pool["metadata"]["namespace"] = NAMESPACE
    pool["spec"]["selector"]["matchLabels"] = labels or {"app": "vllm"}
    pool["spec"]["targetPorts"] = [{"number": port} for port in ports]
    status, message = cluster.apply(pool, dry_run=False)
    assert status in (200, 201), message


def delete(cluster: Cluster, path: str) -> None:
    status, answer = cluster.call("DELETE", path)
    assert status == 200, answer


def discovery(kubeconfig: Path) -> AsyncIterator[tuple[PodIdentity, ...]]:
    options = KubernetesOptions(
        inference_pool=POOL_NAME,
        namespace=NAMESPACE,
        kubeconfig=str(kubeconfig),
        retry_initial=0.1,
        retry_max=1.0,
    )
    return KubernetesDiscovery(options).updates()


async def until(
    updates: AsyncIterator[tuple[PodIdentity, ...]],
    condition: Callable[[dict[str, str]], bool],
    timeout: float = 20,
) -> dict[str, str]:
    """Read pod sets until one satisfies ``condition`` (name -> address)."""

    async def read() -> dict[str, str]:
        while True:
            pods = {pod.name: pod.address for pod in await anext(updates)}
            if condition(pods):
                return pods

    return await asyncio.wait_for(read(), timeout)


async def test_without_the_crd_the_pool_is_an_error_at_start(cluster: Cluster) -> None:
    """Runs first, before any test installs the CRD (file order; a fresh cluster per module)."""
    if cluster.call("GET", POOLS)[0] != 404:
        pytest.fail("the CRD is installed already: run this file on its own cluster")
    updates = discovery(cluster.kubeconfig)
    with pytest.raises(DiscoveryError, match=r"HTTP 404 .* is not served: is its CRD installed"):
        await asyncio.wait_for(anext(updates), 30)
    await updates.aclose()  # type: ignore[attr-defined]


async def test_the_pool_and_its_pods_are_followed_with_the_manifests_role(
    cluster: Cluster, policyd_kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    put_pod(cluster, "vllm-0", "10.0.0.10")
    put_pod(cluster, "vllm-1", "10.0.0.11")
    put_pod(cluster, "other", "10.0.0.12", app="other")
    put_pod(cluster, "starting", None, ready=False)
    put_pool(cluster, [8000])
    updates = discovery(policyd_kubeconfig)
    try:
        pods = await until(updates, lambda p: True)
        assert pods == {"vllm-0": "10.0.0.10:8000", "vllm-1": "10.0.0.11:8000"}

        # Data-parallel ranks: one candidate per target port.
        put_pool(cluster, [8000, 8001])
        pods = await until(updates, lambda p: "vllm-0-rank-1" in p)
        assert pods == {
            "vllm-0-rank-0": "10.0.0.10:8000",
            "vllm-0-rank-1": "10.0.0.10:8001",
            "vllm-1-rank-0": "10.0.0.11:8000",
            "vllm-1-rank-1": "10.0.0.11:8001",
        }
        put_pool(cluster, [8000])
        await until(updates, lambda p: set(p) == {"vllm-0", "vllm-1"})

        # A pod becoming ready joins; the selector changing moves the pool.
        put_pod(cluster, "starting", "10.0.0.13")
        await until(updates, lambda p: set(p) == {"vllm-0", "vllm-1", "starting"})
        put_pool(cluster, [8000], app="other")
        assert await until(updates, lambda p: set(p) == {"other"}) == {"other": "10.0.0.12:8000"}

        # Deleted: the last pods stay followed; created again: its spec is taken.
        with caplog.at_level(logging.WARNING, logger="policyd.pool.inference_pool"):
            delete(cluster, f"{POOLS}/{POOL_NAME}")
            deadline = time.monotonic() + 20
            while "was deleted" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                await asyncio.sleep(0.05)
        put_pod(cluster, "other-2", "10.0.0.14", app="other")
        await until(updates, lambda p: set(p) == {"other", "other-2"})
        put_pool(cluster, [8000])
        await until(updates, lambda p: set(p) == {"vllm-0", "vllm-1", "starting"})
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def test_a_pool_created_after_start_is_waited_for(
    cluster: Cluster, policyd_kubeconfig: Path
) -> None:
    """With the Role's resourceNames, a get of the missing pool is a 404 naming it."""
    status, _ = cluster.call("DELETE", f"{POOLS}/{POOL_NAME}")
    assert status in (200, 404)
    put_pod(cluster, "vllm-0", "10.0.0.10")
    updates = discovery(policyd_kubeconfig)
    try:
        first = asyncio.ensure_future(anext(updates))
        await asyncio.sleep(2)
        assert not first.done()
        put_pool(cluster, [8000])
        pods = {pod.name for pod in await asyncio.wait_for(first, 20)}
        assert "vllm-0" in pods
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def test_a_service_account_without_the_role_is_refused_at_start(
    cluster: Cluster, crds: None, tmp_path: Path
) -> None:
    stranger = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "stranger", "namespace": NAMESPACE},
    }
    status, message = cluster.apply(stranger, dry_run=False)
    assert status in (200, 201), message
    token = cluster.service_account_token(NAMESPACE, "stranger")
    updates = discovery(cluster.kubeconfig_for(token, tmp_path / "kubeconfig"))
    with pytest.raises(DiscoveryError, match=r"refused to get InferencePool .* HTTP 403"):
        await asyncio.wait_for(anext(updates), 30)
    await updates.aclose()  # type: ignore[attr-defined]


def test_the_real_crd_refuses_the_pools_policyd_would_ignore(cluster: Cluster, crds: None) -> None:
    """Why a bad pool object is rare: the CRD's schema refuses most; policyd checks anyway."""
    (pool,) = manifest("inferencepool.yaml")
    pool["metadata"]["namespace"] = NAMESPACE
    bad_specs = []
    changes: list[Callable[[dict[str, Any]], object]] = [
        lambda spec: spec.pop("targetPorts"),
        lambda spec: spec.update(targetPorts=[{"number": 8000}, {"number": 8000}]),
        lambda spec: spec["selector"].update(matchLabels={}),
        lambda spec: spec["selector"].update(matchLabels={"app": "a,b"}),
    ]
    for change in changes:
        bad = copy.deepcopy(pool)
        change(bad["spec"])
        bad_specs.append(cluster.create(bad, NAMESPACE))
    assert all(status == 422 for status, _ in bad_specs), bad_specs


async def test_a_pool_of_pods_on_loopback_is_scraped_and_ready(
    cluster: Cluster, policyd_kubeconfig: Path
) -> None:
    """The whole pool (discovery, scraping, snapshots) on the pod the real API server names,
    a vLLM metrics page served on loopback: what ``policyd serve --inference-pool`` runs."""
    server = MetricsServer(vllm_text(waiting=3))
    await server.start()
    port = int(server.address.rsplit(":", 1)[1])
    for name in ("vllm-0", "vllm-1", "starting", "other", "other-2"):
        cluster.call("DELETE", f"{PODS}/{name}?gracePeriodSeconds=0")
    put_pod(cluster, "loopback", "127.0.0.1", app="loopback")
    put_pool(cluster, [port], app="loopback")
    options = KubernetesOptions(
        inference_pool=POOL_NAME, namespace=NAMESPACE, kubeconfig=str(policyd_kubeconfig)
    )
    pool = Pool(KubernetesDiscovery(options), ScrapeConfig(interval=0.1, in_process=True))
    try:
        await asyncio.wait_for(pool.start(), 30)
        assert await pool.wait_ready(20)
        (pod,) = pool.snapshot().candidates
        assert (pod.name, pod.address, pod.waiting_queue) == ("loopback", server.address, 3)
    finally:
        await pool.stop()
        await server.stop()
