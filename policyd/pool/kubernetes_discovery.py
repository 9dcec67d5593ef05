"""Pods of a Kubernetes namespace chosen by a label selector: list, then watch.

The official ``kubernetes`` client does what it is good at (kubeconfig and
in-cluster credentials, TLS, token refresh, building the requests); the raw
JSON is read here, since the generated models deserialize every field of
every pod and the client's ``Watch`` helper cannot be interrupted from another
thread. The blocking list/watch loop runs in one dedicated thread and hands
complete pod sets to the event loop; closing the iterator shuts the watch's
socket down so the thread ends at once.

The loop follows client-go's reflector: list (paged by ``limit``/``continue``)
and remember the list's ``resourceVersion``; watch from it with bookmarks and
a server-side timeout, every event advancing the version; when the server
ends a watch, watch again from there; ``410 Gone`` (as an HTTP status or as an
ERROR event) means the version was compacted away, so list again; anything
else backs off (exponential, jittered) and resumes from the last version.

A pod is a candidate when it is Running, its Ready condition is True, it has
a pod IP and is not being deleted; its address is ``podIP:target_port``.
The service account needs ``list`` and ``watch`` on ``pods`` in the namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import urllib3

from policyd.pool.discovery import DiscoveryError, PodIdentity, join_address

log = logging.getLogger(__name__)

_SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True, slots=True)
class KubernetesOptions:
    """Which pods to follow and how patiently.

    ``namespace`` ``None`` means the namespace policyd runs in (in a cluster),
    else the kubeconfig context's, else ``default``. ``watch_timeout`` is the
    server-side lifetime of one watch request (seconds); ``request_timeout``
    bounds connecting and each list request.
    """

    selector: str
    target_port: int
    namespace: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    watch_timeout: int = 300
    request_timeout: float = 30.0
    page_size: int = 500
    retry_initial: float = 0.5
    retry_max: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.target_port < 65536:
            raise ValueError(f"target port {self.target_port} is not a port number")
        if self.watch_timeout <= 0 or self.request_timeout <= 0 or self.page_size <= 0:
            raise ValueError("watch timeout, request timeout and page size must be positive")
        if not 0 < self.retry_initial <= self.retry_max:
            raise ValueError("retry delays must satisfy 0 < retry_initial <= retry_max")


class KubernetesDiscovery:
    """A ``Discovery`` source following pods through the Kubernetes API.

    ``configuration`` is a ``kubernetes.client.Configuration`` to use instead
    of loading one (from ``options.kubeconfig``, the in-cluster service
    account, or the default kubeconfig).
    """

    def __init__(self, options: KubernetesOptions, *, configuration: Any = None) -> None:
        self.options = options
        self._configuration = configuration

    async def updates(self) -> AsyncIterator[tuple[PodIdentity, ...]]:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[PodIdentity, ...] | DiscoveryError] = asyncio.Queue()

        def deliver(item: tuple[PodIdentity, ...] | DiscoveryError) -> None:
            # A closed loop raises RuntimeError: nobody listens any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(inbox.put_nowait, item)

        worker = _ListWatch(self.options, self._configuration, deliver)
        thread = threading.Thread(target=worker.run, name="policyd-pod-watch", daemon=True)
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
            worker.stop()
            # The read in progress ends at once; a connection attempt in progress
            # cannot be interrupted, and the daemon thread then ends with it.
            await asyncio.to_thread(thread.join, 2.0)


class _GoneError(Exception):
    """The resource version is too old to watch from (410 Gone)."""


class _WatchError(Exception):
    """The server ended a watch with an ERROR event other than 410."""


class _ListWatch:
    """The blocking list/watch loop; runs in its own thread."""

    def __init__(
        self,
        options: KubernetesOptions,
        configuration: Any,
        deliver: Callable[[tuple[PodIdentity, ...] | DiscoveryError], None],
    ) -> None:
        self._options = options
        self._configuration = configuration
        self._deliver = deliver
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._response: urllib3.BaseHTTPResponse | None = None
        self._pods: dict[str, PodIdentity] = {}  # candidate pods by name
        self._version: str | None = None
        self._published: tuple[PodIdentity, ...] | None = None
        self._events = 0  # watch events received, to tell a live watch from a failing one

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            response = self._response
        if response is not None:
            _shutdown(response)

    def run(self) -> None:
        try:
            self._run()
        except Exception as error:  # a bug: surface it instead of dying silently
            log.exception("the pod watch thread failed")
            self._deliver(DiscoveryError(f"the pod watch failed: {error!r}"))

    def _run(self) -> None:
        # Imported here, in the watch thread: loading the client takes about a
        # second that the event loop should not wait for.
        from kubernetes import client  # noqa: PLC0415
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        try:
            configuration, namespace = self._connection_settings()
        except Exception as error:  # the config loaders raise several kinds
            self._deliver(DiscoveryError(f"cannot load Kubernetes credentials: {error}"))
            return
        api = client.CoreV1Api(client.ApiClient(configuration))
        where = f"pods in namespace {namespace!r} matching {self._options.selector!r}"
        delay = self._options.retry_initial
        expired_in_a_row = 0  # a server that keeps saying 410 must not be relisted in a loop
        while not self._stopping.is_set():
            events_before = self._events
            try:
                if self._version is None:
                    self._list(api, namespace)
                self._watch(api, namespace)
                delay = self._options.retry_initial
                expired_in_a_row = 0
                continue
            except _GoneError:
                problem = f"resource version {self._version} expired"
                self._version = None
            except ApiException as error:
                if self._stopping.is_set():
                    return
                if self._published is None and error.status in (401, 403, 404):
                    self._deliver(
                        DiscoveryError(
                            f"the Kubernetes API refused to list {where}: "
                            f"HTTP {error.status} {error.reason}"
                        )
                    )
                    return
                problem = f"HTTP {error.status} {error.reason}"
                if error.status == 410:  # an expired continue token or watch version
                    self._version = None
            except (urllib3.exceptions.HTTPError, OSError, ValueError, _WatchError) as error:
                if self._stopping.is_set():
                    return
                problem = str(error) or type(error).__name__
            if self._events > events_before:
                expired_in_a_row = 0
            if self._version is None and self._published is not None:
                expired_in_a_row += 1
                if expired_in_a_row == 1:  # the normal case: list again at once
                    log.info("pod watch: %s; listing again", problem)
                    continue
            log.warning("pod watch: %s; retrying in %.1f s", problem, delay)
            self._stopping.wait(random.uniform(delay / 2, delay))
            delay = min(delay * 2, self._options.retry_max)

    def _connection_settings(self) -> tuple[Any, str]:
        from kubernetes import client, config  # noqa: PLC0415

        options = self._options
        if self._configuration is not None:
            return self._configuration, options.namespace or "default"
        configuration = client.Configuration()
        if options.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            namespace = options.namespace or _service_account_namespace() or "default"
            return configuration, namespace
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=options.kubeconfig,
            context=options.context,
            client_configuration=configuration,
        )
        if options.namespace:
            return configuration, options.namespace
        contexts, current = config.list_kube_config_contexts(options.kubeconfig)  # type: ignore[no-untyped-call]
        chosen = next((c for c in contexts if c.get("name") == options.context), current)
        return configuration, (chosen or {}).get("context", {}).get("namespace") or "default"

    def _list(self, api: Any, namespace: str) -> None:
        pods: dict[str, PodIdentity] = {}
        token: str | None = None
        while True:
            response = api.list_namespaced_pod(
                namespace,
                label_selector=self._options.selector or None,
                limit=self._options.page_size,
                _continue=token,
                _preload_content=False,
                _request_timeout=self._options.request_timeout,
            )
            with self._tracking(response):
                document = json.loads(response.read())
            for item in document.get("items") or ():
                name, identity = self._identity(item)
                if identity is not None:
                    pods[name] = identity
            metadata = document.get("metadata") or {}
            token = metadata.get("continue") or None
            if token is None:
                version = metadata.get("resourceVersion")
                if not version:
                    raise ValueError("the pod list carries no resourceVersion")
                break
        self._pods = pods
        self._version = str(version)
        self._publish()

    def _watch(self, api: Any, namespace: str) -> None:
        options = self._options
        response = api.list_namespaced_pod(
            namespace,
            label_selector=options.selector or None,
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=self._version,
            timeout_seconds=options.watch_timeout,
            _preload_content=False,
            _request_timeout=(options.request_timeout, options.watch_timeout + 30),
        )
        with self._tracking(response):
            self._follow(response)

    def _follow(self, response: urllib3.BaseHTTPResponse) -> None:
        for line in _lines(response):
            event = json.loads(line)
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise _GoneError
                raise _WatchError(f"watch ended with {obj.get('code')}: {obj.get('message')}")
            self._events += 1
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if kind in ("ADDED", "MODIFIED"):
                name, identity = self._identity(obj)
                changed = self._pods.get(name) != identity
                if identity is None:
                    self._pods.pop(name, None)
                else:
                    self._pods[name] = identity
            elif kind == "DELETED":
                name = (obj.get("metadata") or {}).get("name", "")
                changed = self._pods.pop(name, None) is not None
            elif kind == "BOOKMARK":
                changed = False
            else:
                log.warning("pod watch: ignoring an event of unknown type %r", kind)
                continue
            if version:
                self._version = str(version)
            if changed:
                self._publish()

    def _identity(self, pod: dict[str, Any]) -> tuple[str, PodIdentity | None]:
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
        address = join_address(str(ip), self._options.target_port)
        return name, PodIdentity.of(name, address, metadata.get("labels") or {})

    def _publish(self) -> None:
        chosen: dict[str, PodIdentity] = {}
        for identity in sorted(self._pods.values(), key=lambda pod: pod.name):
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

    @contextlib.contextmanager
    def _tracking(self, response: urllib3.BaseHTTPResponse) -> Iterator[None]:
        """Makes ``response`` the one ``stop()`` shuts down while it is read."""
        with self._lock:
            self._response = response
        try:
            if self._stopping.is_set():
                _shutdown(response)
            yield
        finally:
            with self._lock:
                self._response = None
            response.close()


def _lines(response: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
    """A watch stream's JSON lines, however its chunks split them."""
    pending = b""
    for chunk in response.stream(amt=None, decode_content=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if pending.strip():
        yield pending


def _shutdown(response: urllib3.BaseHTTPResponse) -> None:
    """Wake a thread blocked reading ``response`` (its socket stops reading)."""
    with contextlib.suppress(ValueError, RuntimeError, OSError):  # closed or released already
        response.shutdown()


def _service_account_namespace() -> str | None:
    try:
        with open(_SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as file:
            return file.read().strip() or None
    except OSError:
        return None
