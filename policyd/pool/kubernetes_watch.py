"""The Kubernetes list + watch loop the discovery sources share, on a thread of its own.

The official ``kubernetes`` client does what it is good at (kubeconfig and
in-cluster credentials, TLS, token refresh, building the requests); the raw
JSON is read here, since the generated models deserialize every field of
every object and the client's ``Watch`` helper cannot be interrupted from
another thread. Each ``Reflector`` runs its blocking loop in one dedicated
thread; ``stop()`` shuts the watch's socket down so the thread ends at once.

The loop follows client-go's reflector: list (or get) and remember the
``resourceVersion``; watch from it with bookmarks and a server-side timeout,
every event advancing the version; when the server ends a watch, watch again
from there; ``410 Gone`` (as an HTTP status or as an ERROR event) means the
version was compacted away, so list again; anything else backs off
(exponential, jittered) and resumes from the last version. ``401``, ``403``
or ``404`` before the first list succeeded is an error that makes the source
useless: it is delivered as a ``DiscoveryError``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import urllib3

from policyd.pool.discovery import DiscoveryError, PodIdentity

log = logging.getLogger(__name__)

_SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

Delivery = Callable[[tuple[PodIdentity, ...] | DiscoveryError], None]


@dataclass(frozen=True, slots=True)
class KubernetesOptions:
    """Which pods to follow and how patiently.

    Either ``selector`` and ``target_port`` name the pods, or
    ``inference_pool`` names an InferencePool whose selector and target ports
    do (``policyd.pool.inference_pool``). ``namespace`` ``None`` means the
    namespace policyd runs in (in a cluster), else the kubeconfig context's,
    else ``default``. ``watch_timeout`` is the server-side lifetime of one
    watch request (seconds); ``request_timeout`` bounds connecting and each
    list request.
    """

    selector: str = ""
    target_port: int = 8000
    inference_pool: str | None = None
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
        if self.inference_pool is not None and not self.inference_pool:
            raise ValueError("the InferencePool's name is empty")
        if self.inference_pool is not None and self.selector:
            raise ValueError("an InferencePool names its pods: give it no label selector")
        if self.watch_timeout <= 0 or self.request_timeout <= 0 or self.page_size <= 0:
            raise ValueError("watch timeout, request timeout and page size must be positive")
        if not 0 < self.retry_initial <= self.retry_max:
            raise ValueError("retry delays must satisfy 0 < retry_initial <= retry_max")


@dataclass(frozen=True, slots=True)
class PodSelection:
    """The pods to follow (a label selector) and the ports each one serves on.

    A pod serving on several ports (vLLM's data-parallel ranks) is one
    candidate per port.
    """

    selector: str
    ports: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.ports:
            raise ValueError("no target port")
        for port in self.ports:
            if not 0 < port < 65536:
                raise ValueError(f"target port {port} is not a port number")
        if len(set(self.ports)) != len(self.ports):
            raise ValueError(f"target ports {list(self.ports)} repeat a port")


class GoneError(Exception):
    """The resource version is too old to watch from (410 Gone)."""


class WatchError(Exception):
    """The server ended a watch with an ERROR event other than 410."""


class Reflector:
    """One list + watch loop; subclasses say what is listed, watched and done with it.

    ``run`` is the thread's target. Subclasses implement ``_client``,
    ``_list`` (which sets ``_version`` and ``_started``), ``_watch`` (which
    calls ``_watch_from_version`` with its list call and selector), ``_handle``
    for each watch event and ``_where`` for messages; ``_ready`` and
    ``_interrupted`` let one wait for its input or start over (the pod watch of
    an InferencePool).
    """

    label = "watch"  # in log messages: "pod watch", "InferencePool watch"

    def __init__(self, options: KubernetesOptions, configuration: Any, deliver: Delivery) -> None:
        self._options = options
        self._configuration = configuration
        self._deliver = deliver
        self._stopping = threading.Event()
        self._wake = threading.Event()  # ends a backoff or a wait early
        self._lock = threading.Lock()
        self._response: urllib3.BaseHTTPResponse | None = None
        self._version: str | None = None
        self._started = False  # a list succeeded once: refusals are no longer fatal
        self._events = 0  # watch events received, to tell a live watch from a failing one

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._interrupt()

    def run(self) -> None:
        try:
            self._run()
        except Exception as error:  # a bug: surface it instead of dying silently
            log.exception("the %s thread failed", self.label)
            self._deliver(DiscoveryError(f"the {self.label} failed: {error!r}"))

    def _run(self) -> None:
        # Imported here, in the watch thread: loading the client takes about a
        # second that the event loop should not wait for.
        from kubernetes import client  # noqa: PLC0415
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        try:
            configuration, namespace = connection_settings(self._options, self._configuration)
        except Exception as error:  # the config loaders raise several kinds
            self._deliver(DiscoveryError(f"cannot load Kubernetes credentials: {error}"))
            return
        api = self._client(client.ApiClient(configuration))
        delay = self._options.retry_initial
        expired_in_a_row = 0  # a server that keeps saying 410 must not be relisted in a loop
        while not self._stopping.is_set():
            if not self._ready():
                continue
            events_before = self._events
            try:
                if self._version is None:
                    self._list(api, namespace)
                self._watch(api, namespace)
                delay = self._options.retry_initial
                expired_in_a_row = 0
                continue
            except GoneError:
                problem = f"resource version {self._version} expired"
                self._version = None
            except ApiException as error:
                if self._stopping.is_set():
                    return
                if not self._started and error.status in (401, 403, 404):
                    self._deliver(DiscoveryError(self._refusal(namespace, error)))
                    return
                problem = f"HTTP {error.status} {error.reason}"
                if error.status == 410:  # an expired continue token or watch version
                    self._version = None
            except (urllib3.exceptions.HTTPError, OSError, ValueError, WatchError) as error:
                if self._stopping.is_set():
                    return
                problem = str(error) or type(error).__name__
            if self._interrupted():
                continue  # what to follow changed under the request: start over now
            if self._events > events_before:
                expired_in_a_row = 0
            if self._version is None and self._started:
                expired_in_a_row += 1
                if expired_in_a_row == 1:  # the normal case: list again at once
                    log.info("%s: %s; listing again", self.label, problem)
                    continue
            log.warning("%s: %s; retrying in %.1f s", self.label, problem, delay)
            self._wake.wait(random.uniform(delay / 2, delay))
            self._wake.clear()
            delay = min(delay * 2, self._options.retry_max)

    # What subclasses provide.

    def _client(self, api_client: Any) -> Any:
        raise NotImplementedError

    def _list(self, api: Any, namespace: str) -> None:
        raise NotImplementedError

    def _watch(self, api: Any, namespace: str) -> None:
        raise NotImplementedError

    def _handle(self, kind: str, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    def _where(self, namespace: str) -> str:
        raise NotImplementedError

    def _refusal(self, namespace: str, error: Any) -> str:
        return (
            f"the Kubernetes API refused to list {self._where(namespace)}: "
            f"HTTP {error.status} {error.reason}"
        )

    def _ready(self) -> bool:
        """Whether to list or watch now (False: the loop comes back after a wait)."""
        return True

    def _interrupted(self) -> bool:
        """Whether the request just failed because what to follow changed."""
        return False

    # Shared by subclasses.

    def _watch_from_version(self, call: Callable[..., Any], *args: Any, **selectors: Any) -> None:
        """Watches with ``call``, one of the client's list calls, from ``_version`` (with
        bookmarks, the server ending it after ``watch_timeout``), reading its events until
        it ends, unless what to follow changed before the first read."""
        options = self._options
        response = call(
            *args,
            **selectors,
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=self._version,
            timeout_seconds=options.watch_timeout,
            _preload_content=False,
            _request_timeout=(options.request_timeout, options.watch_timeout + 30),
        )
        with self._tracking(response):
            if not self._interrupted():
                self._follow(response)

    def _follow(self, response: urllib3.BaseHTTPResponse) -> None:
        """Reads a watch stream to its end, passing each event to ``_handle``."""
        for line in _lines(response):
            event = json.loads(line)
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise GoneError
                raise WatchError(f"watch ended with {obj.get('code')}: {obj.get('message')}")
            if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
                log.warning("%s: ignoring an event of unknown type %r", self.label, kind)
                continue
            self._events += 1
            version = (obj.get("metadata") or {}).get("resourceVersion")
            self._handle(kind, obj)
            if version:
                self._version = str(version)

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

    def _interrupt(self) -> None:
        """Wake the thread from the read in progress, if any."""
        with self._lock:
            response = self._response
        if response is not None:
            _shutdown(response)


def connection_settings(options: KubernetesOptions, configuration: Any) -> tuple[Any, str]:
    """The client configuration and the namespace to use (loads the kubernetes client)."""
    from kubernetes import client, config  # noqa: PLC0415

    if configuration is not None:
        return configuration, options.namespace or "default"
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
