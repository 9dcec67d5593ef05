"""Kubernetes discovery against a wire-level fake API server on loopback.

The discovery uses the real ``kubernetes`` client (kubeconfig loading, bearer
token, urllib3) in its own thread; only the API server is a fake
(``fake_kube_apiserver``), since no cluster runs here.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from policyd.pool import DiscoveryError, PodIdentity
from policyd.pool.kubernetes_discovery import KubernetesDiscovery, KubernetesOptions

from .fake_kube_apiserver import FakeKubeApiServer, LabelSelector

NAMESPACE = "inference"
TOKEN = "s3cret-token"
Updates = AsyncIterator[tuple[PodIdentity, ...]]


@pytest.fixture
async def server() -> AsyncIterator[FakeKubeApiServer]:
    fake = FakeKubeApiServer(token=TOKEN)
    await fake.start()
    yield fake
    await fake.stop()


def kubeconfig(tmp_path: Path, server: FakeKubeApiServer, token: str = TOKEN) -> str:
    path = tmp_path / f"kubeconfig-{token}"
    path.write_text(
        f"""\
apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster: {{server: "{server.url}"}}
users:
- name: policyd
  user: {{token: "{token}"}}
contexts:
- name: fake
  context: {{cluster: fake, user: policyd, namespace: {NAMESPACE}}}
current-context: fake
"""
    )
    return str(path)


def options(tmp_path: Path, server: FakeKubeApiServer, **overrides: object) -> KubernetesOptions:
    settings: dict[str, object] = {
        "selector": "app=vllm",
        "target_port": 8000,
        "kubeconfig": kubeconfig(tmp_path, server),
        "retry_initial": 0.05,
        "retry_max": 0.2,
        "request_timeout": 5.0,
    }
    settings.update(overrides)
    return KubernetesOptions(**settings)  # type: ignore[arg-type]


async def until(
    updates: Updates, condition: Callable[[dict[str, PodIdentity]], bool], timeout: float = 30
) -> dict[str, PodIdentity]:
    """Read pod sets until one satisfies ``condition`` (by pod name)."""

    async def read() -> dict[str, PodIdentity]:
        while True:
            pods = {pod.name: pod for pod in await anext(updates)}
            if condition(pods):
                return pods

    return await asyncio.wait_for(read(), timeout)


def vllm(server: FakeKubeApiServer, name: str, **kwargs: object) -> None:
    labels = {"app": "vllm", "model": "llama"}
    server.add_pod(name, namespace=NAMESPACE, labels=labels, **kwargs)  # type: ignore[arg-type]


async def test_the_first_set_is_listed_in_pages_with_kubeconfig_credentials(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    vllm(server, "ready-1", ip="10.1.0.1")
    vllm(server, "ready-2", ip="10.1.0.2")
    vllm(server, "ready-3", ip="fd00::3")
    vllm(server, "pending", phase="Pending", ready=False, ip=None)
    vllm(server, "not-ready", ready=False)
    vllm(server, "no-ip", ip=None)
    vllm(server, "finished", phase="Succeeded", ready=False)
    vllm(server, "terminating")
    server.update_pod("terminating", namespace=NAMESPACE, terminating=True)
    server.add_pod("other-app", namespace=NAMESPACE, labels={"app": "web"})
    server.add_pod("elsewhere", namespace="default", labels={"app": "vllm"})

    updates = KubernetesDiscovery(options(tmp_path, server, page_size=3)).updates()
    try:
        pods = await asyncio.wait_for(anext(updates), 30)
    finally:
        await updates.aclose()  # type: ignore[attr-defined]

    assert pods == (
        PodIdentity.of("ready-1", "10.1.0.1:8000", {"app": "vllm", "model": "llama"}),
        PodIdentity.of("ready-2", "10.1.0.2:8000", {"app": "vllm", "model": "llama"}),
        PodIdentity.of("ready-3", "[fd00::3]:8000", {"app": "vllm", "model": "llama"}),
    )
    lists = server.lists()
    assert len(lists) == 3  # 8 matching pods, pages of 3
    assert all(r.path == f"/api/v1/namespaces/{NAMESPACE}/pods" for r in lists)
    assert all(r.query["labelSelector"] == "app=vllm" and r.query["limit"] == "3" for r in lists)
    assert "continue" not in lists[0].query and lists[1].query["continue"]
    assert all(r.headers["Authorization"] == f"Bearer {TOKEN}" for r in server.requests)


async def test_the_watch_follows_readiness_restarts_relabels_and_deletions(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    vllm(server, "a", ip="10.1.0.1")
    listed_at = server.revision
    updates = KubernetesDiscovery(options(tmp_path, server)).updates()
    try:
        assert set(await until(updates, lambda p: True)) == {"a"}

        vllm(server, "b", phase="Pending", ready=False, ip=None)
        server.update_pod("b", namespace=NAMESPACE, phase="Running", ip="10.1.0.2")
        server.update_pod("b", namespace=NAMESPACE, ready=True)
        pods = await until(updates, lambda p: "b" in p)
        assert pods["b"].address == "10.1.0.2:8000"

        # A container restart: not ready for a while, then ready again.
        server.update_pod("a", namespace=NAMESPACE, ready=False)
        await until(updates, lambda p: "a" not in p)
        server.update_pod("a", namespace=NAMESPACE, ready=True)
        await until(updates, lambda p: "a" in p)

        # Relabelled out of the selector, then back in.
        server.update_pod("b", namespace=NAMESPACE, labels={"app": "other"})
        await until(updates, lambda p: "b" not in p)
        server.update_pod("b", namespace=NAMESPACE, labels={"app": "vllm", "tier": "gold"})
        pods = await until(updates, lambda p: "b" in p)
        assert dict(pods["b"].labels) == {"app": "vllm", "tier": "gold"}

        # Deleted gracefully (terminating first), then recreated under the same name.
        server.update_pod("a", namespace=NAMESPACE, terminating=True)
        await until(updates, lambda p: "a" not in p)
        server.delete_pod("a", namespace=NAMESPACE)
        vllm(server, "a", ip="10.1.0.77")
        pods = await until(updates, lambda p: "a" in p)
        assert pods["a"].address == "10.1.0.77:8000"
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
    assert len(server.lists()) == 1  # all of it from one watch, no relist
    watch = server.watches()[0]
    assert watch.query["allowWatchBookmarks"] == "true"
    assert watch.query["resourceVersion"] == str(listed_at)


async def test_an_expired_watch_relists_and_catches_up(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    vllm(server, "a")
    vllm(server, "b")
    updates = KubernetesDiscovery(options(tmp_path, server)).updates()
    try:
        await until(updates, lambda p: set(p) == {"a", "b"})
        await _watch_open(server)
        # Changes the watcher never gets: history compacted, the watch ended with 410.
        server.delete_pod("b", namespace=NAMESPACE)
        vllm(server, "c")
        server.compact()
        server.expire_watches()
        pods = await until(updates, lambda p: set(p) == {"a", "c"})
        assert "b" not in pods
        # Following on from the relist works as before.
        vllm(server, "d")
        await until(updates, lambda p: set(p) == {"a", "c", "d"})
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
    assert len(server.lists()) == 2
    relist_version = server.watches()[-1].query["resourceVersion"]
    assert int(relist_version) >= server.revision - 1


async def test_a_watch_refused_with_http_410_relists(tmp_path: Path) -> None:
    server = FakeKubeApiServer(token=TOKEN, expired_watch_as_status=True)
    await server.start()
    vllm(server, "a")
    updates = KubernetesDiscovery(options(tmp_path, server)).updates()
    try:
        await until(updates, lambda p: set(p) == {"a"})
        await _watch_open(server)
        server.drop_watches()
        server.delete_pod("a", namespace=NAMESPACE)
        vllm(server, "z")
        server.compact()
        await until(updates, lambda p: set(p) == {"z"})
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
        await server.stop()
    assert len(server.lists()) == 2


@pytest.mark.parametrize("as_status", [False, True])
async def test_a_server_that_expires_every_watch_is_not_relisted_in_a_loop(
    tmp_path: Path, as_status: bool
) -> None:
    server = FakeKubeApiServer(token=TOKEN, expired_watch_as_status=as_status)
    await server.start()
    vllm(server, "a")
    server.expire_every_watch = True
    updates = KubernetesDiscovery(options(tmp_path, server)).updates()
    try:
        await until(updates, lambda p: set(p) == {"a"})
        async with asyncio.timeout(30):
            while len(server.lists()) < 2:  # the first expired watch lists again
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.6)
        # Backing off from 50 ms and doubling leaves room for a handful of lists (a
        # loaded machine makes fewer, never more).
        assert len(server.lists()) <= 8
        server.expire_every_watch = False
        vllm(server, "b")
        await until(updates, lambda p: set(p) == {"a", "b"})
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
        await server.stop()


async def test_a_dropped_watch_resumes_from_its_last_version_without_relisting(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    vllm(server, "a")
    updates = KubernetesDiscovery(options(tmp_path, server)).updates()
    try:
        await until(updates, lambda p: set(p) == {"a"})
        vllm(server, "b")
        await until(updates, lambda p: set(p) == {"a", "b"})
        seen_version = server.revision
        server.drop_watches()
        server.delete_pod("a", namespace=NAMESPACE)  # while nobody watches
        await until(updates, lambda p: set(p) == {"b"})
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
    assert len(server.lists()) == 1
    assert server.watches()[1].query["resourceVersion"] == str(seen_version)


async def test_a_watch_the_server_ends_is_renewed_from_its_version(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    vllm(server, "a")
    updates = KubernetesDiscovery(options(tmp_path, server, watch_timeout=1)).updates()
    try:
        await until(updates, lambda p: set(p) == {"a"})
        vllm(server, "b")
        await until(updates, lambda p: set(p) == {"a", "b"})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while len(server.watches()) < 2 and loop.time() < deadline:
            await asyncio.sleep(0.02)
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
    first, second = server.watches()[:2]
    assert first.query["timeoutSeconds"] == "1"
    assert second.query["resourceVersion"] == str(server.revision)
    assert len(server.lists()) == 1


async def test_bookmarks_move_the_resume_version_past_compactions(tmp_path: Path) -> None:
    server = FakeKubeApiServer(token=TOKEN, bookmark_interval=0.05)
    await server.start()
    vllm(server, "a")
    updates = KubernetesDiscovery(options(tmp_path, server)).updates()
    try:
        await until(updates, lambda p: set(p) == {"a"})
        await _watch_open(server)
        for i in range(3):  # changes this watch does not select, yet they move the version
            server.add_pod(f"web-{i}", namespace=NAMESPACE, labels={"app": "web"})
        sent = server.bookmarks
        async with asyncio.timeout(30):  # bookmarks with the version after those changes
            while server.bookmarks < sent + 2:
                await asyncio.sleep(0.01)
        server.compact()
        server.drop_watches()
        vllm(server, "b")
        await until(updates, lambda p: set(p) == {"a", "b"})
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
        await server.stop()
    assert len(server.lists()) == 1  # resumed from the bookmark, no 410, no relist


async def test_the_api_server_going_down_and_back_is_ridden_out(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    vllm(server, "a")
    updates = KubernetesDiscovery(options(tmp_path, server)).updates()
    try:
        await until(updates, lambda p: set(p) == {"a"})
        await server.stop()
        vllm(server, "b")
        await asyncio.sleep(0.3)  # a few failed reconnections
        await server.start(server.port)
        await until(updates, lambda p: set(p) == {"a", "b"})
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def test_an_unreachable_api_server_at_start_is_waited_for(tmp_path: Path) -> None:
    server = FakeKubeApiServer(token=TOKEN)
    await server.start()
    port = server.port
    settings = options(tmp_path, server)
    await server.stop()
    vllm(server, "a")
    updates = KubernetesDiscovery(settings).updates()
    try:
        first = asyncio.ensure_future(anext(updates))
        await asyncio.sleep(0.3)
        assert not first.done()
        await server.start(port)
        assert [pod.name for pod in await asyncio.wait_for(first, 30)] == ["a"]
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
        await server.stop()


@pytest.mark.parametrize("refusal", ["wrong token", "forbidden"])
async def test_refused_access_at_start_is_an_error(
    server: FakeKubeApiServer, tmp_path: Path, refusal: str
) -> None:
    settings = options(tmp_path, server)
    if refusal == "wrong token":
        settings = options(tmp_path, server, kubeconfig=kubeconfig(tmp_path, server, "nope"))
    else:
        server.forbidden = True
    updates = KubernetesDiscovery(settings).updates()
    with pytest.raises(DiscoveryError) as error:
        await asyncio.wait_for(anext(updates), 30)
    code = "401" if refusal == "wrong token" else "403"
    assert str(error.value).startswith(
        f"the Kubernetes API refused to list pods in namespace '{NAMESPACE}' "
        f"matching 'app=vllm': HTTP {code}"
    )


async def test_missing_credentials_are_an_error(tmp_path: Path) -> None:
    settings = KubernetesOptions(
        selector="app=vllm", target_port=8000, kubeconfig=str(tmp_path / "absent")
    )
    with pytest.raises(DiscoveryError, match="cannot load Kubernetes credentials"):
        await asyncio.wait_for(anext(KubernetesDiscovery(settings).updates()), 30)


async def test_closing_the_source_ends_its_watch_thread(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    vllm(server, "a")
    updates = KubernetesDiscovery(options(tmp_path, server)).updates()
    await until(updates, lambda p: True)
    await _watch_open(server)
    async with asyncio.timeout(30):  # far less than the watch's 300 s it must not wait for
        await updates.aclose()  # type: ignore[attr-defined]
    assert not [t for t in threading.enumerate() if t.name == "policyd-pod-watch"]


def test_the_fake_parses_label_selectors_like_the_api_server() -> None:
    pod = {"metadata": {"labels": {"app": "vllm", "tier": "gold"}}}
    assert LabelSelector.parse("app=vllm,tier in (gold, silver)").matches(pod)
    assert LabelSelector.parse("app==vllm,!canary,tier").matches(pod)
    assert not LabelSelector.parse("app!=vllm").matches(pod)
    assert not LabelSelector.parse("tier notin (gold)").matches(pod)
    with pytest.raises(ValueError):
        LabelSelector.parse("app=vllm,=x")


async def _watch_open(server: FakeKubeApiServer) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while server.open_watches == 0:
        assert loop.time() < deadline, "the discovery never opened a watch"
        await asyncio.sleep(0.01)
