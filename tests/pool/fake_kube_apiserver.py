"""A FAKE Kubernetes API server: pods, InferencePools and their objects, listed and watched.

No cluster can run here, so the Kubernetes discovery is tested against this
stand-in (``tests/real`` runs the same discovery against the real
kube-apiserver). It is a real HTTP server (aiohttp on 127.0.0.1) that speaks
what the API server says on the wire for ``GET /api/v1/namespaces/{ns}/pods``
and ``GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools``
(and ``.../inferencepools/{name}``, a get), and for
``GET /apis/{group}/v1alpha2/namespaces/{ns}/inferenceobjectives`` and
``.../inferencemodelrewrites`` in the groups ``llm-d.ai`` and
``inference.networking.x-k8s.io`` (``serve_object_groups`` says which groups
have the CRDs; another answers 404 without details, as for a resource not
served):

- lists: ``PodList`` JSON with ``metadata.resourceVersion``, paged by
  ``limit`` / ``continue`` (pages served from the first page's snapshot; an
  expired continue token is ``410 Expired``), filtered by ``labelSelector``;
- watches (``watch=true``): a chunked stream of newline-separated JSON events
  ``ADDED`` / ``MODIFIED`` / ``DELETED`` / ``BOOKMARK`` / ``ERROR``, replayed
  from the requested ``resourceVersion``, with the selector applied to each
  change the way the watch cache does (a pod relabelled out of the selector
  arrives as ``DELETED``, back in as ``ADDED``), ``timeoutSeconds`` honoured,
  bookmarks when asked for; a version older than the compacted history gets
  an ``ERROR`` event with a ``Status`` of code 410 (or, when
  ``expired_watch_as_status`` is set, an HTTP 410 ``Status`` response);
- the field selector ``metadata.name=NAME`` (what a client sends to list or
  watch one object, the form RBAC's ``resourceNames`` authorizes); a get of a
  missing object is a ``404 NotFound`` ``Status`` naming it in ``details``,
  a resource not served (``serve_inference_pools = False``: no CRD) a 404
  ``Status`` without details;
- bearer-token authentication (``401``) and forbidden modes (``403``, for
  everything or per resource), with ``Status`` bodies.

It does not implement anything the discovery does not send (other field
selectors, other resources such as EndpointSlices, writes): such requests get
400 or 404.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

PODS = "pods"
POOLS = "inferencepools"
POOL_GROUP = "inference.networking.k8s.io"
POOL_API = f"/apis/{POOL_GROUP}/v1"
OBJECT_GROUPS = ("llm-d.ai", "inference.networking.x-k8s.io")
OBJECT_KINDS = {
    "inferenceobjectives": "InferenceObjective",
    "inferencemodelrewrites": "InferenceModelRewrite",
}
# resource -> (kind, apiVersion); the objects' resources are "group/plural"
KINDS = {
    PODS: ("Pod", "v1"),
    POOLS: ("InferencePool", f"{POOL_GROUP}/v1"),
    **{
        f"{group}/{plural}": (kind, f"{group}/v1alpha2")
        for group in OBJECT_GROUPS
        for plural, kind in OBJECT_KINDS.items()
    },
}


@dataclass
class Change:
    revision: int
    resource: str
    namespace: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


@dataclass
class Request:
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    resource: str = PODS
    name: str | None = None  # a get of one object

    @property
    def is_watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


_EXPIRE = "expire"
_DROP = "drop"


@dataclass(eq=False)
class _Watcher:
    resource: str
    namespace: str
    selector: LabelSelector
    name: str | None  # from the field selector metadata.name=NAME
    queue: asyncio.Queue[Change | str] = field(default_factory=asyncio.Queue)


class FakeKubeApiServer:
    """The fake. Mutate pods with ``add_pod`` / ``update_pod`` / ``delete_pod``,
    InferencePools with ``put_pool`` / ``delete_pool``."""

    def __init__(
        self,
        *,
        token: str | None = None,
        bookmark_interval: float | None = None,
        expired_watch_as_status: bool = False,
        split_events: bool = True,
    ) -> None:
        self.token = token
        self.forbidden = False
        self.forbidden_resources: set[str] = set()
        self.serve_inference_pools = True  # False: the CRD is not installed
        self.serve_object_groups: set[str] = {OBJECT_GROUPS[0]}  # where the objects' CRDs are
        self.expire_every_watch = False  # a broken server: every watch is "too old"
        self.bookmark_interval = bookmark_interval
        self.bookmarks = 0  # sent so far, with the revision current at the time
        self.expired_watch_as_status = expired_watch_as_status
        self.split_events = split_events  # write each event in two chunks
        self.requests: list[Request] = []
        self._revision = 1
        self._compacted = 0  # watches from versions below this get 410
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # resource, ns, name
        self._history: list[Change] = []
        self._continues: dict[str, list[dict[str, Any]]] = {}
        self._watchers: set[_Watcher] = set()
        self._runner: web.AppRunner | None = None
        self._next_ip = 10
        self.url = ""

    # Serving.

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._collection)
        app.router.add_get(POOL_API + "/namespaces/{namespace}/inferencepools", self._collection)
        app.router.add_get(POOL_API + "/namespaces/{namespace}/inferencepools/{name}", self._get)
        for group in OBJECT_GROUPS:
            for plural in OBJECT_KINDS:
                path = f"/apis/{group}/v1alpha2/namespaces/{{namespace}}/{plural}"
                app.router.add_get(path, self._collection)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{bound}"
        return self.url

    async def stop(self) -> None:
        """Go down (state is kept: ``start`` again to come back, like a restart)."""
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    def lists(self, resource: str = PODS) -> list[Request]:
        return [r for r in self.requests if r.resource == resource and not r.is_watch]

    def watches(self, resource: str = PODS) -> list[Request]:
        return [r for r in self.requests if r.resource == resource and r.is_watch]

    def open_watches_of(self, resource: str) -> int:
        return sum(1 for watcher in self._watchers if watcher.resource == resource)

    # State changes.

    def add_pod(
        self,
        name: str,
        *,
        namespace: str = "default",
        labels: Mapping[str, str] | None = None,
        phase: str = "Running",
        ready: bool = True,
        ip: str | None = "",
    ) -> dict[str, Any]:
        if ip == "":
            ip = f"10.1.0.{self._next_ip}"
            self._next_ip += 1
        pod = {
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "labels": dict(labels or {}),
                "creationTimestamp": "2025-01-01T00:00:00Z",
            },
            "spec": {"containers": [{"name": "vllm", "ports": [{"containerPort": 8000}]}]},
            "status": _status(phase, ready, ip),
        }
        self._commit(PODS, namespace, name, pod)
        return pod

    def update_pod(
        self,
        name: str,
        *,
        namespace: str = "default",
        labels: Mapping[str, str] | None = None,
        phase: str | None = None,
        ready: bool | None = None,
        ip: str | None = "",
        terminating: bool = False,
    ) -> None:
        pod = _copy(self._objects[(PODS, namespace, name)])
        status = pod["status"]
        if labels is not None:
            pod["metadata"]["labels"] = dict(labels)
        current_ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])
        )
        pod["status"] = _status(
            phase or status["phase"],
            current_ready if ready is None else ready,
            status.get("podIP") if ip == "" else ip,
        )
        if terminating:
            pod["metadata"]["deletionTimestamp"] = "2025-01-01T00:01:00Z"
        self._commit(PODS, namespace, name, pod)

    def delete_pod(self, name: str, *, namespace: str = "default") -> None:
        self._commit(PODS, namespace, name, None)

    def put_pool(
        self,
        name: str,
        *,
        namespace: str = "default",
        match_labels: Mapping[str, str] | None = None,
        ports: tuple[int, ...] = (8000,),
        spec: dict[str, Any] | None = None,
    ) -> None:
        """Create or replace an InferencePool: ``match_labels`` and ``ports``, or a whole
        ``spec`` as given (for objects the real API server's schema would refuse)."""
        if spec is None:
            spec = {
                "selector": {"matchLabels": dict(match_labels or {})},
                "targetPorts": [{"number": port} for port in ports],
                "endpointPickerRef": {"name": "policyd", "port": {"number": 9002}},
            }
        before = self._objects.get((POOLS, namespace, name))
        pool = {
            "apiVersion": f"{POOL_GROUP}/v1",
            "kind": "InferencePool",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": before["metadata"]["uid"] if before else str(uuid.uuid4()),
                "generation": before["metadata"]["generation"] + 1 if before else 1,
                "creationTimestamp": "2025-01-01T00:00:00Z",
            },
            "spec": spec,
        }
        self._commit(POOLS, namespace, name, pool)

    def delete_pool(self, name: str, *, namespace: str = "default") -> None:
        self._commit(POOLS, namespace, name, None)

    def put_object(
        self,
        resource: str,
        name: str,
        spec: dict[str, Any],
        *,
        namespace: str = "default",
        created: str = "2025-01-01T00:00:00Z",
    ) -> None:
        """Create or replace an InferenceObjective or InferenceModelRewrite (``resource``:
        ``group/plural``) with ``spec`` as given."""
        kind, api_version = KINDS[resource]
        before = self._objects.get((resource, namespace, name))
        obj = {
            "apiVersion": api_version,
            "kind": kind,
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": before["metadata"]["uid"] if before else str(uuid.uuid4()),
                "creationTimestamp": created,
            },
            "spec": spec,
        }
        self._commit(resource, namespace, name, obj)

    def delete_object(self, resource: str, name: str, *, namespace: str = "default") -> None:
        self._commit(resource, namespace, name, None)

    def compact(self) -> None:
        """Forget history: watches resuming from any older version get 410."""
        self._history.clear()
        self._continues.clear()
        self._compacted = self._revision

    def expire_watches(self) -> None:
        """End every open watch with 410, dropping events not yet sent (a slow watcher)."""
        for watcher in self._watchers:
            _drain(watcher.queue)
            watcher.queue.put_nowait(_EXPIRE)

    def drop_watches(self) -> None:
        """Cut every open watch connection without ending its stream."""
        for watcher in self._watchers:
            watcher.queue.put_nowait(_DROP)

    def _commit(self, resource: str, namespace: str, name: str, obj: dict[str, Any] | None) -> None:
        self._revision += 1
        key = (resource, namespace, name)
        before = self._objects.get(key)
        if obj is None:
            if before is None:
                raise KeyError(name)
            del self._objects[key]
            after = None
        else:
            obj["metadata"]["resourceVersion"] = str(self._revision)
            self._objects[key] = obj
            after = obj
        change = Change(self._revision, resource, namespace, before, after)
        self._history.append(change)
        for watcher in self._watchers:
            watcher.queue.put_nowait(change)

    # The endpoints.

    def _refused(self, request: web.Request, resource: str) -> web.Response | None:
        """The answer to a request the server refuses, if it does."""
        namespace = request.match_info["namespace"]
        if (
            self.token is not None
            and request.headers.get("Authorization") != f"Bearer {self.token}"
        ):
            return _status_response(401, "Unauthorized", "Unauthorized")
        group = resource.partition("/")[0] if "/" in resource else ""
        if self.forbidden or resource in self.forbidden_resources:
            shown = "" if resource == PODS else (group or POOL_GROUP)
            verb = "get" if "name" in request.match_info else "list"
            return _status_response(
                403,
                "Forbidden",
                f'{resource} is forbidden: User "policyd" cannot {verb} resource "{resource}" '
                f'in API group "{shown}" in the namespace "{namespace}"',
            )
        # After authorization, as the API server: one not allowed to list gets 403 either way.
        if (resource == POOLS and not self.serve_inference_pools) or (
            group and group not in self.serve_object_groups
        ):
            return _status_response(
                404, "NotFound", "the server could not find the requested resource"
            )
        return None

    async def _get(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.requests.append(
            Request(request.path, dict(request.query), dict(request.headers), POOLS, name)
        )
        refused = self._refused(request, POOLS)
        if refused is not None:
            return refused
        obj = self._objects.get((POOLS, request.match_info["namespace"], name))
        if obj is None:
            return _status_response(
                404,
                "NotFound",
                f'{POOLS}.{POOL_GROUP} "{name}" not found',
                details={"name": name, "group": POOL_GROUP, "kind": POOLS},
            )
        return web.json_response(_copy(obj))

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/api/v1/"):
            resource = PODS
        elif "/inferencepools" in request.path:
            resource = POOLS
        else:  # /apis/{group}/v1alpha2/namespaces/{ns}/{plural}
            parts = request.path.split("/")
            resource = f"{parts[2]}/{parts[-1]}"
        self.requests.append(
            Request(request.path, dict(request.query), dict(request.headers), resource)
        )
        namespace = request.match_info["namespace"]
        refused = self._refused(request, resource)
        if refused is not None:
            return refused
        name = None
        if "fieldSelector" in request.query:
            field_name, _, value = request.query["fieldSelector"].replace("==", "=").partition("=")
            if field_name != "metadata.name" or not value:
                return _status_response(400, "BadRequest", "the fake does only metadata.name=")
            name = value
        try:
            selector = LabelSelector.parse(request.query.get("labelSelector", ""))
        except ValueError as error:
            return _status_response(400, "BadRequest", f"unable to parse requirement: {error}")
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, _Watcher(resource, namespace, selector, name))
        return self._list(request, resource, namespace, selector, name)

    def _list(
        self,
        request: web.Request,
        resource: str,
        namespace: str,
        selector: LabelSelector,
        name: str | None,
    ) -> web.Response:
        token = request.query.get("continue")
        if token:
            if token not in self._continues:
                return _status_response(
                    410, "Expired", "The provided continue parameter is too old"
                )
            items = self._continues.pop(token)
            revision = json.loads(base64.b64decode(token))["rv"]
        else:
            items = [
                _copy(obj)
                for (kind, ns, key), obj in sorted(self._objects.items())
                if kind == resource
                and ns == namespace
                and name in (None, key)
                and selector.matches(obj)
            ]
            revision = self._revision
        metadata: dict[str, Any] = {"resourceVersion": str(revision)}
        limit = int(request.query.get("limit", "0") or 0)
        if limit and len(items) > limit:
            rest = items[limit:]
            items = items[:limit]
            token = base64.b64encode(
                json.dumps({"rv": revision, "start": rest[0]["metadata"]["name"]}).encode()
            ).decode()
            self._continues[token] = rest
            metadata["continue"] = token
            metadata["remainingItemCount"] = len(rest)
        kind, version = KINDS[resource]
        body = {"kind": f"{kind}List", "apiVersion": version, "metadata": metadata, "items": items}
        return web.json_response(body)

    async def _watch(self, request: web.Request, watcher: _Watcher) -> web.StreamResponse:
        version = request.query.get("resourceVersion", "")
        since = int(version) if version.isdigit() else 0
        bookmarks = request.query.get("allowWatchBookmarks") in ("true", "1")
        timeout = float(request.query.get("timeoutSeconds", "0") or 0) or None
        expired = self.expire_every_watch or (since and since < self._compacted)
        if expired and self.expired_watch_as_status:
            return _status_response(410, "Expired", f"too old resource version: {since}")
        if not expired:
            if since:
                backlog = [c for c in self._history if c.revision > since]
            else:  # no version: the current state first, as synthetic ADDED events
                backlog = [
                    Change(self._revision, kind, ns, None, obj)
                    for (kind, ns, _), obj in sorted(self._objects.items())
                ]
            for change in backlog:
                watcher.queue.put_nowait(change)
            self._watchers.add(watcher)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            if expired:
                await self._send(response, _expired_event(since))
                await response.write_eof()
                return response
            await self._stream(request, response, watcher, bookmarks, timeout)
        finally:
            self._watchers.discard(watcher)
        return response

    async def _stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        watcher: _Watcher,
        bookmarks: bool,
        timeout: float | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            wait = None if deadline is None else max(deadline - loop.time(), 0)
            if bookmarks and self.bookmark_interval is not None:
                wait = self.bookmark_interval if wait is None else min(wait, self.bookmark_interval)
            try:
                item = await asyncio.wait_for(watcher.queue.get(), wait)
            except TimeoutError:
                if deadline is not None and loop.time() >= deadline:
                    await response.write_eof()
                    return
                await self._send(response, _bookmark(watcher.resource, self._revision))
                self.bookmarks += 1
                continue
            if item == _DROP:
                if request.transport is not None:  # None: the client has gone already
                    request.transport.abort()
                return
            if item == _EXPIRE:
                await self._send(response, _expired_event(self._compacted))
                await response.write_eof()
                return
            assert isinstance(item, Change)
            event = _event_for(item, watcher)
            if event is not None:
                await self._send(response, event)

    async def _send(self, response: web.StreamResponse, event: dict[str, Any]) -> None:
        line = json.dumps(event).encode() + b"\n"
        if self.split_events:
            middle = len(line) // 2
            await response.write(line[:middle])
            await response.write(line[middle:])
        else:
            await response.write(line)


def _event_for(change: Change, watcher: _Watcher) -> dict[str, Any] | None:
    """The event a watcher with a label selector sees for one change, if any."""
    if change.resource != watcher.resource or change.namespace != watcher.namespace:
        return None
    named = change.after if change.after is not None else change.before
    if watcher.name is not None and (named or {})["metadata"]["name"] != watcher.name:
        return None
    was = change.before is not None and watcher.selector.matches(change.before)
    now = change.after is not None and watcher.selector.matches(change.after)
    if now and not was:
        kind, obj = "ADDED", change.after
    elif now and was:
        kind, obj = "MODIFIED", change.after
    elif was:
        kind = "DELETED"
        obj = change.after if change.after is not None else _copy(change.before or {})
        obj["metadata"]["resourceVersion"] = str(change.revision)
    else:
        return None
    assert obj is not None
    object_kind, version = KINDS[change.resource]
    return {"type": kind, "object": {"kind": object_kind, "apiVersion": version, **_copy(obj)}}


def _expired_event(version: int) -> dict[str, Any]:
    return {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: {version}",
            "reason": "Expired",
            "code": 410,
        },
    }


def _bookmark(resource: str, revision: int) -> dict[str, Any]:
    kind, version = KINDS[resource]
    return {
        "type": "BOOKMARK",
        "object": {
            "kind": kind,
            "apiVersion": version,
            "metadata": {"resourceVersion": str(revision)},
        },
    }


def _status(phase: str, ready: bool, ip: str | None) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
            {"type": "ContainersReady", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return status


def _status_response(
    code: int, reason: str, message: str, *, details: dict[str, str] | None = None
) -> web.Response:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details is not None:
        body["details"] = details
    return web.json_response(body, status=code)


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(obj))  # type: ignore[no-any-return]


def _drain(queue: asyncio.Queue[Change | str]) -> None:
    while not queue.empty():
        queue.get_nowait()


_REQUIREMENT = re.compile(
    r"\s*(?P<not>!)?\s*(?P<key>[A-Za-z0-9_./-]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9_.-]*)"
    r"|\s(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?\s*"
)


@dataclass(frozen=True)
class LabelSelector:
    """Equality-, set- and existence-based label selectors, as the API server parses them."""

    requirements: tuple[tuple[str, str, frozenset[str]], ...] = ()

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        requirements: list[tuple[str, str, frozenset[str]]] = []
        for part in _split_requirements(text):
            match = _REQUIREMENT.fullmatch(part)
            if match is None:
                raise ValueError(repr(part))
            key = match["key"]
            if match["not"]:
                if match["op"] or match["setop"]:
                    raise ValueError(repr(part))
                requirements.append((key, "!exists", frozenset()))
            elif match["op"]:
                op = "!=" if match["op"] == "!=" else "="
                requirements.append((key, op, frozenset([match["value"]])))
            elif match["setop"]:
                values = frozenset(v.strip() for v in match["values"].split(",") if v.strip())
                requirements.append((key, match["setop"], values))
            else:
                requirements.append((key, "exists", frozenset()))
        return cls(tuple(requirements))

    def matches(self, pod: Mapping[str, Any]) -> bool:
        labels: Mapping[str, str] = pod["metadata"].get("labels") or {}
        for key, op, values in self.requirements:
            present = key in labels
            value = labels.get(key)
            if op == "=" and value not in values:
                return False
            if op == "!=" and value in values:
                return False
            if op == "in" and value not in values:
                return False
            if op == "notin" and present and value in values:
                return False
            if op == "exists" and not present:
                return False
            if op == "!exists" and present:
                return False
        return True


def _split_requirements(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current)
    return [part for part in parts if part.strip()]
