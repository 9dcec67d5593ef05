"""Discovery from an InferencePool, against the wire-level fake API server on loopback.

The pool's selector and target ports choose the pods; its changes are
followed; a bad or deleted pool keeps the last good selection. The same
discovery runs against the real kube-apiserver, with the real CRD, in
``tests/real/test_inference_pool.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from policyd.pool import DiscoveryError, PodIdentity
from policyd.pool.inference_pool import selection_of
from policyd.pool.kubernetes_discovery import KubernetesDiscovery, KubernetesOptions, PodSelection

from .fake_kube_apiserver import POOLS, FakeKubeApiServer
from .test_kubernetes_discovery import NAMESPACE, TOKEN, Updates, kubeconfig, until

POOL = "llama"


@pytest.fixture
async def server() -> Any:
    fake = FakeKubeApiServer(token=TOKEN)
    await fake.start()
    yield fake
    await fake.stop()


def discovery(tmp_path: Path, server: FakeKubeApiServer, **overrides: Any) -> Updates:
    settings: dict[str, Any] = {
        "inference_pool": POOL,
        "kubeconfig": kubeconfig(tmp_path, server),
        "retry_initial": 0.05,
        "retry_max": 0.2,
        "request_timeout": 5.0,
    }
    settings.update(overrides)
    return KubernetesDiscovery(KubernetesOptions(**settings)).updates()


def pod(server: FakeKubeApiServer, name: str, ip: str, **labels: str) -> None:
    server.add_pod(name, namespace=NAMESPACE, labels=labels or {"app": "vllm"}, ip=ip)


def pool(server: FakeKubeApiServer, ports: tuple[int, ...] = (8000,), **labels: str) -> None:
    server.put_pool(POOL, namespace=NAMESPACE, match_labels=labels or {"app": "vllm"}, ports=ports)


def addresses(pods: dict[str, PodIdentity]) -> dict[str, str]:
    return {name: identity.address for name, identity in pods.items()}


async def test_the_pools_selector_and_port_choose_the_pods(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    pod(server, "vllm-0", "10.1.0.1")
    pod(server, "vllm-1", "fd00::2")
    pod(server, "web", "10.1.0.3", app="web")
    server.add_pod("elsewhere", namespace="default", labels={"app": "vllm"})
    pool(server, ports=(8200,))
    updates = discovery(tmp_path, server)
    try:
        first = await asyncio.wait_for(anext(updates), 30)
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
    assert first == (
        PodIdentity.of("vllm-0", "10.1.0.1:8200", {"app": "vllm"}),
        PodIdentity.of("vllm-1", "[fd00::2]:8200", {"app": "vllm"}),
    )
    (get,) = server.lists(POOLS)
    assert get.name == POOL and get.path.endswith(f"/namespaces/{NAMESPACE}/inferencepools/{POOL}")
    watch = server.watches(POOLS)[0]
    assert watch.query["fieldSelector"] == f"metadata.name={POOL}"  # RBAC resourceNames allow it
    assert watch.query["allowWatchBookmarks"] == "true"
    assert server.lists()[0].query["labelSelector"] == "app=vllm"
    assert all(r.headers["Authorization"] == f"Bearer {TOKEN}" for r in server.requests)


async def test_several_target_ports_make_one_candidate_per_rank(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    pod(server, "vllm-0", "10.1.0.1")
    pod(server, "vllm-1", "10.1.0.2")
    pool(server, ports=(8000, 8001, 8002))
    updates = discovery(tmp_path, server)
    try:
        pods = await until(updates, lambda p: True)
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
    assert addresses(pods) == {
        "vllm-0-rank-0": "10.1.0.1:8000",
        "vllm-0-rank-1": "10.1.0.1:8001",
        "vllm-0-rank-2": "10.1.0.1:8002",
        "vllm-1-rank-0": "10.1.0.2:8000",
        "vllm-1-rank-1": "10.1.0.2:8001",
        "vllm-1-rank-2": "10.1.0.2:8002",
    }
    assert dict(pods["vllm-1-rank-2"].labels) == {"app": "vllm"}  # the pod's labels, per rank


async def test_changes_to_the_pool_change_the_pods(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    pod(server, "a", "10.1.0.1", app="vllm", model="llama")
    pod(server, "b", "10.1.0.2", app="vllm", model="qwen")
    pool(server)
    updates = discovery(tmp_path, server)
    try:
        assert set(await until(updates, lambda p: True)) == {"a", "b"}
        # The selector narrows: only the llama pod, listed again with the new selector.
        pool(server, app="vllm", model="llama")
        assert set(await until(updates, lambda p: set(p) == {"a"})) == {"a"}
        assert server.lists()[-1].query["labelSelector"] == "app=vllm,model=llama"
        # Pod changes are followed under the new selector.
        pod(server, "c", "10.1.0.3", app="vllm", model="llama")
        pod(server, "d", "10.1.0.4", app="vllm", model="qwen")
        await until(updates, lambda p: set(p) == {"a", "c"})
        # Other ports: the same pods, at the new ports.
        pool(server, ports=(9000, 9001), app="vllm", model="llama")
        pods = await until(updates, lambda p: "a-rank-1" in p)
        assert addresses(pods) == {
            "a-rank-0": "10.1.0.1:9000",
            "a-rank-1": "10.1.0.1:9001",
            "c-rank-0": "10.1.0.3:9000",
            "c-rank-1": "10.1.0.3:9001",
        }
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
    assert len(server.lists(POOLS)) == 1  # every pool change came on the one watch


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"targetPorts": [{"number": 8000}]}, "spec.selector is missing"),
        (
            {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]},
            "spec.selector.matchLabels is missing or empty",
        ),
        (
            {
                "selector": {"matchLabels": {"app": "vllm"}, "matchExpressions": []},
                "targetPorts": [{"number": 8000}],
            },
            "spec.selector.matchExpressions is not understood",
        ),
        (
            {"selector": {"matchLabels": {"app": "a,b"}}, "targetPorts": [{"number": 8000}]},
            "is not a label value",
        ),
        ({"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": []}, "spec.targetPorts"),
        (
            {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 70000}]},
            "not a port number",
        ),
        (
            {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": "80"}]},
            "spec.targetPorts[0].number is not a number",
        ),
    ],
)
async def test_a_bad_pool_is_logged_and_the_last_good_one_kept(
    server: FakeKubeApiServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    spec: dict[str, Any],
    reason: str,
) -> None:
    pod(server, "a", "10.1.0.1")
    pool(server)
    updates = discovery(tmp_path, server)
    try:
        await until(updates, lambda p: set(p) == {"a"})
        with caplog.at_level(logging.ERROR, logger="policyd.pool.inference_pool"):
            server.put_pool(POOL, namespace=NAMESPACE, spec=spec)
            await _logged(caplog, reason)
        assert "keeping pods matching app=vllm on ports [8000]" in caplog.text
        pod(server, "b", "10.1.0.2")  # still followed by the last good selector
        await until(updates, lambda p: set(p) == {"a", "b"})
        pool(server, ports=(8001,))  # a good spec again is taken
        pods = await until(updates, lambda p: p["a"].address == "10.1.0.1:8001")
        assert set(pods) == {"a", "b"}
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def test_a_deleted_pool_keeps_its_pods_followed_until_it_is_back(
    server: FakeKubeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pod(server, "a", "10.1.0.1")
    pod(server, "b", "10.1.0.2", app="other")
    pool(server)
    updates = discovery(tmp_path, server)
    try:
        await until(updates, lambda p: set(p) == {"a"})
        with caplog.at_level(logging.WARNING, logger="policyd.pool.inference_pool"):
            server.delete_pool(POOL, namespace=NAMESPACE)
            await _logged(caplog, "was deleted; following pods matching app=vllm")
        pod(server, "c", "10.1.0.3")
        await until(updates, lambda p: set(p) == {"a", "c"})  # pods still followed
        server.put_pool(POOL, namespace=NAMESPACE, match_labels={"app": "other"})
        await until(updates, lambda p: set(p) == {"b"})  # the re-created pool's spec
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def test_a_pool_missing_at_start_is_waited_for(
    server: FakeKubeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pod(server, "a", "10.1.0.1")
    updates = discovery(tmp_path, server)
    try:
        with caplog.at_level(logging.WARNING, logger="policyd.pool.inference_pool"):
            first = asyncio.ensure_future(anext(updates))
            await _logged(caplog, f"InferencePool '{POOL}' in namespace '{NAMESPACE}' does not")
        await asyncio.sleep(0.2)
        assert not first.done()
        assert not server.lists()  # no pods listed before the pool says which
        pool(server)
        assert [p.name for p in await asyncio.wait_for(first, 30)] == ["a"]
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def test_a_bad_pool_at_start_is_waited_out(
    server: FakeKubeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pod(server, "a", "10.1.0.1")
    server.put_pool(POOL, namespace=NAMESPACE, spec={"selector": {"matchLabels": {"app": "vllm"}}})
    updates = discovery(tmp_path, server)
    try:
        with caplog.at_level(logging.ERROR, logger="policyd.pool.inference_pool"):
            first = asyncio.ensure_future(anext(updates))
            await _logged(caplog, "spec.targetPorts is missing or empty; waiting for a usable")
        assert not first.done() and not server.lists()
        pool(server)
        assert [p.name for p in await asyncio.wait_for(first, 30)] == ["a"]
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def test_an_expired_pool_watch_gets_the_pool_again(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    pod(server, "a", "10.1.0.1", app="vllm")
    pod(server, "b", "10.1.0.2", app="other")
    pool(server)
    updates = discovery(tmp_path, server)
    try:
        await until(updates, lambda p: set(p) == {"a"})
        await _watches_open(server, POOLS)
        server.expire_watches()  # drops what it has not sent yet
        pool(server, app="other")  # a change this watch never delivers
        server.compact()
        await until(updates, lambda p: set(p) == {"b"})
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
    assert len(server.lists(POOLS)) == 2


@pytest.mark.parametrize(
    ("trouble", "message"),
    [
        (
            "no CRD",
            f"the Kubernetes API refused to get InferencePool '{POOL}' in namespace "
            f"'{NAMESPACE}': HTTP 404 Not Found (inferencepools.inference.networking.k8s.io/v1 "
            "is not served: is its CRD installed?)",
        ),
        (
            "pools forbidden",
            f"the Kubernetes API refused to get InferencePool '{POOL}' in namespace "
            f"'{NAMESPACE}': HTTP 403 Forbidden",
        ),
        (
            "pods forbidden",
            f"the Kubernetes API refused to list pods in namespace '{NAMESPACE}' matching "
            "'app=vllm': HTTP 403 Forbidden",
        ),
    ],
)
async def test_refusals_at_start_are_errors(
    server: FakeKubeApiServer, tmp_path: Path, trouble: str, message: str
) -> None:
    pool(server)
    if trouble == "no CRD":
        server.serve_inference_pools = False
    else:
        server.forbidden_resources.add(POOLS if trouble == "pools forbidden" else "pods")
    updates = discovery(tmp_path, server)
    with pytest.raises(DiscoveryError) as error:
        await asyncio.wait_for(anext(updates), 30)
    assert str(error.value) == message
    await updates.aclose()  # type: ignore[attr-defined]


async def test_closing_the_source_ends_both_watch_threads(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    pod(server, "a", "10.1.0.1")
    pool(server)
    updates = discovery(tmp_path, server)
    await until(updates, lambda p: True)
    await _watches_open(server, POOLS)
    await _watches_open(server, "pods")
    loop = asyncio.get_running_loop()
    started = loop.time()
    await updates.aclose()  # type: ignore[attr-defined]
    assert loop.time() - started < 2
    names = {t.name for t in threading.enumerate()}
    assert not names & {"policyd-pod-watch", "policyd-inference-pool-watch"}


async def test_closing_while_waiting_for_the_pool_ends_both_threads(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    """The pod thread waits for a selection, the pool thread watches for the pool."""
    updates = discovery(tmp_path, server)
    first = asyncio.ensure_future(anext(updates))
    await _watches_open(server, POOLS)
    first.cancel()  # as a signal abandons `policyd serve`'s start
    with pytest.raises(asyncio.CancelledError):
        await first
    loop = asyncio.get_running_loop()
    started = loop.time()
    await updates.aclose()  # type: ignore[attr-defined]
    assert loop.time() - started < 2
    names = {t.name for t in threading.enumerate()}
    assert not names & {"policyd-pod-watch", "policyd-inference-pool-watch"}


def test_selection_of_reads_match_labels_and_ports_in_order() -> None:
    pool = {
        "spec": {
            "selector": {"matchLabels": {"b.example.com/role": "decode", "app": ""}},
            "targetPorts": [{"number": 8002}, {"number": 8000}],
        }
    }
    assert selection_of(pool) == PodSelection("app=,b.example.com/role=decode", (8002, 8000))
    with pytest.raises(ValueError, match="repeat a port"):
        selection_of({"spec": {**pool["spec"], "targetPorts": [{"number": 1}, {"number": 1}]}})
    with pytest.raises(ValueError, match="'-bad' is not a label name"):
        selection_of({"spec": {**pool["spec"], "selector": {"matchLabels": {"-bad": "x"}}}})


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while text not in caplog.text:
        assert loop.time() < deadline, f"never logged {text!r}: {caplog.text}"
        await asyncio.sleep(0.01)


async def _watches_open(server: FakeKubeApiServer, resource: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while server.open_watches_of(resource) == 0:
        assert loop.time() < deadline, f"the discovery never watched {resource}"
        await asyncio.sleep(0.01)
