"""Pods of a Kubernetes namespace chosen by a label selector, or by an InferencePool.

``KubernetesDiscovery`` follows the pods with a list + watch loop
(``kubernetes_watch.Reflector``) in a dedicated thread and hands complete pod
sets to the event loop; closing the iterator shuts the watch's socket down so
the thread ends at once. With ``KubernetesOptions.inference_pool`` a second
thread follows that InferencePool (``inference_pool.PoolWatch``) and gives the
pod watch its selector and target ports, again whenever they change; two more
follow its InferenceObjectives and InferenceModelRewrites
(``inference_objects``), which ``inference_objects()`` returns.

A pod is a candidate when it is Running, its Ready condition is True, it has
a pod IP and is not being deleted; its address is ``podIP:port``. A pod is
one candidate per target port: named as the pod when there is one port, and
``<pod>-rank-<i>`` (``i`` the port's index in the pool's ``targetPorts``, the
reference endpoint picker's naming) when there are several, so the decision
log tells a pod's data-parallel ranks apart. The service account needs
``list`` and ``watch`` on ``pods`` in the namespace (and, for a pool, ``get``
and ``watch`` on that InferencePool, ``list`` and ``watch`` on
``inferenceobjectives`` and ``inferencemodelrewrites``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from policyd.pool.discovery import DiscoveryError, PodIdentity, join_address
from policyd.pool.inference_objects import NO_OBJECTS, InferenceObjects, InferenceObjectsFollower
from policyd.pool.inference_pool import PoolWatch
from policyd.pool.kubernetes_watch import (
    Delivery,
    KubernetesOptions,
    PodSelection,
    Reflector,
)

__all__ = ["KubernetesDiscovery", "KubernetesOptions", "PodSelection"]

log = logging.getLogger(__name__)

# A candidate pod before it is spread over the ports: its IP and its labels.
_Member = tuple[str, dict[str, str]]


class KubernetesDiscovery:
    """A ``Discovery`` source following pods through the Kubernetes API.

    ``configuration`` is a ``kubernetes.client.Configuration`` to use instead
    of loading one (from ``options.kubeconfig``, the in-cluster service
    account, or the default kubeconfig).
    """

    def __init__(self, options: KubernetesOptions, *, configuration: Any = None) -> None:
        self.options = options
        self._configuration = configuration
        self._objects = (
            None
            if options.inference_pool is None
            else InferenceObjectsFollower(options, configuration)
        )

    def inference_objects(self) -> InferenceObjects:
        """The pool's objectives and rewrites in force (none without a pool); never blocks."""
        return NO_OBJECTS if self._objects is None else self._objects.current

    async def updates(self) -> AsyncIterator[tuple[PodIdentity, ...]]:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[PodIdentity, ...] | DiscoveryError] = asyncio.Queue()

        def deliver(item: tuple[PodIdentity, ...] | DiscoveryError) -> None:
            # A closed loop raises RuntimeError: nobody listens any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(inbox.put_nowait, item)

        options = self.options
        pods = PodWatch(options, self._configuration, deliver)
        workers: list[tuple[str, Reflector]] = [("policyd-pod-watch", pods)]
        if options.inference_pool is None:
            pods.retarget(PodSelection(options.selector, (options.target_port,)))
        else:
            pool = PoolWatch(options, self._configuration, deliver, pods.retarget)
            workers.append(("policyd-inference-pool-watch", pool))
            assert self._objects is not None
            workers.extend((f"policyd-{w.plural}-watch", w) for w in self._objects.watches())
        threads = [
            threading.Thread(target=worker.run, name=name, daemon=True) for name, worker in workers
        ]
        for thread in threads:
            thread.start()
        try:
            while True:
                item = await inbox.get()
                while not isinstance(item, DiscoveryError) and not inbox.empty():
                    item = inbox.get_nowait()  # only the newest complete set matters
                if isinstance(item, DiscoveryError):
                    raise item
                yield item
        finally:
            for _, worker in workers:
                worker.stop()
            # The read in progress ends at once; a connection attempt in progress
            # cannot be interrupted, and the daemon thread then ends with it.
            for thread in threads:
                await asyncio.to_thread(thread.join, 2.0)


class PodWatch(Reflector):
    """Lists and watches the pods of a ``PodSelection``; publishes complete pod sets.

    Until ``retarget`` gives it a selection it waits; a new selection makes
    it drop the request in progress and list again.
    """

    label = "pod watch"

    def __init__(self, options: KubernetesOptions, configuration: Any, deliver: Delivery) -> None:
        super().__init__(options, configuration, deliver)
        self._selection: PodSelection | None = None  # the newest, set by retarget
        self._current: PodSelection | None = None  # the one listed and watched
        self._pods: dict[str, _Member] = {}  # candidate pods by name
        self._published: tuple[PodIdentity, ...] | None = None

    def retarget(self, selection: PodSelection) -> None:
        """Follow ``selection`` from now on (any thread)."""
        with self._lock:
            if selection == self._selection:
                return
            self._selection = selection
        self._wake.set()
        self._interrupt()

    def _ready(self) -> bool:
        with self._lock:
            selection = self._selection
        if selection is None:
            self._wake.wait()
            self._wake.clear()
            return False
        if selection != self._current:
            self._current = selection
            self._version = None  # another selector or other ports: list again
        return True

    def _interrupted(self) -> bool:
        with self._lock:
            return self._selection != self._current

    def _client(self, api_client: Any) -> Any:
        from kubernetes import client  # noqa: PLC0415

        return client.CoreV1Api(api_client)

    def _where(self, namespace: str) -> str:
        selector = self._current.selector if self._current else ""
        return f"pods in namespace {namespace!r} matching {selector!r}"

    def _list(self, api: Any, namespace: str) -> None:
        assert self._current is not None
        pods: dict[str, _Member] = {}
        token: str | None = None
        while True:
            response = api.list_namespaced_pod(
                namespace,
                label_selector=self._current.selector or None,
                limit=self._options.page_size,
                _continue=token,
                _preload_content=False,
                _request_timeout=self._options.request_timeout,
            )
            with self._tracking(response):
                document = json.loads(response.read())
            for item in document.get("items") or ():
                name, member = _member(item)
                if member is not None:
                    pods[name] = member
            metadata = document.get("metadata") or {}
            token = metadata.get("continue") or None
            if token is None:
                version = metadata.get("resourceVersion")
                if not version:
                    raise ValueError("the pod list carries no resourceVersion")
                break
        self._pods = pods
        self._version = str(version)
        self._started = True
        self._publish()

    def _watch(self, api: Any, namespace: str) -> None:
        assert self._current is not None
        self._watch_from_version(
            api.list_namespaced_pod, namespace, label_selector=self._current.selector or None
        )

    def _handle(self, kind: str, obj: dict[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED"):
            name, member = _member(obj)
            changed = self._pods.get(name) != member
            if member is None:
                self._pods.pop(name, None)
            else:
                self._pods[name] = member
        elif kind == "DELETED":
            name = (obj.get("metadata") or {}).get("name", "")
            changed = self._pods.pop(name, None) is not None
        else:  # BOOKMARK
            changed = False
        if changed:
            self._publish()

    def _publish(self) -> None:
        if self._interrupted():
            return  # made with the selection just replaced; the next list publishes
        assert self._current is not None
        ports = self._current.ports
        chosen: dict[str, PodIdentity] = {}
        for pod, (ip, labels) in sorted(self._pods.items()):
            for rank, port in enumerate(ports):
                name = pod if len(ports) == 1 else f"{pod}-rank-{rank}"
                identity = PodIdentity.of(name, join_address(ip, port), labels)
                if identity.address in chosen:
                    log.warning(
                        "pods %s and %s share the address %s; routing to %s only",
                        chosen[identity.address].name,
                        identity.name,
                        identity.address,
                        chosen[identity.address].name,
                    )
                    continue
                chosen[identity.address] = identity
        current = tuple(sorted(chosen.values(), key=lambda pod: pod.name))
        if current != self._published:
            self._published = current
            self._deliver(current)


def _member(pod: dict[str, Any]) -> tuple[str, _Member | None]:
    """A pod's name, and its IP and labels when it is a candidate."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = str(metadata.get("name", ""))
    ip = status.get("podIP")
    ready = any(
        condition.get("type") == "Ready" and condition.get("status") == "True"
        for condition in status.get("conditions") or ()
    )
    if (
        not name
        or metadata.get("deletionTimestamp")
        or status.get("phase") != "Running"
        or not ready
        or not ip
    ):
        return name, None
    return name, (str(ip), dict(metadata.get("labels") or {}))
