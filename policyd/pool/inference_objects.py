"""The InferenceObjectives and InferenceModelRewrites of the InferencePool policyd serves.

The inference request API puts two kinds of object beside an InferencePool,
each naming it by ``spec.poolRef`` (``name``, and ``group``, by default
``inference.networking.k8s.io``):

- ``InferenceObjective``: a name a request picks with the objective header
  (``policyd.policy.client_headers``) and its ``spec.priority``, an integer
  (unset: 0). The router turns it into the request's criticality.
- ``InferenceModelRewrite``: ``spec.rules``, each with ``matches`` (models by
  exact name; none: every model) and weighted ``targets`` (``modelRewrite``,
  ``weight``). The request is routed as the target model and its body's
  ``model`` becomes that name, as the reference endpoint picker does. A rule
  matching the model by name wins over one matching every model; among those,
  the oldest object's (``creationTimestamp``), and in one object the first in
  list order. When some targets carry a weight, only those are chosen, in
  proportion; when none does, each is as likely.

The API group moved with the endpoint picker from the Gateway API Inference
Extension (``inference.networking.x-k8s.io/v1alpha2``) to llm-d's router
(``llm-d.ai/v1alpha2``); like that router, policyd follows the new group when
the API server serves it and the old one otherwise. A cluster without either
CRD simply has no objects: looked for again every ``retry_max`` seconds,
said once. A refusal (401, 403) is logged and the objects are not followed:
routing goes on without them, since they only refine it.

``ObjectsWatch`` lists and watches one kind in the pool's namespace, in a
thread of its own (``kubernetes_watch.Reflector``); ``InferenceObjectsFollower``
combines both kinds into an immutable ``InferenceObjects`` and swaps it in,
so the serving path reads it with one attribute read and no lock.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from policyd.pool.discovery import DiscoveryError, PodIdentity
from policyd.pool.inference_pool import GROUP as POOL_GROUP
from policyd.pool.kubernetes_watch import KubernetesOptions, Reflector

log = logging.getLogger(__name__)

# The groups the two kinds are served in, the one to prefer first.
GROUPS: Final = ("llm-d.ai", "inference.networking.x-k8s.io")
VERSION: Final = "v1alpha2"
OBJECTIVES: Final = "inferenceobjectives"
REWRITES: Final = "inferencemodelrewrites"
MAX_WEIGHT: Final = 1_000_000  # the CRD's bound on a target's weight


@dataclass(frozen=True, slots=True)
class RewriteTarget:
    model: str
    weight: int | None  # None: no weight given


@dataclass(frozen=True, slots=True)
class RewriteRule:
    """One rule of an InferenceModelRewrite: the models it matches and where they go."""

    models: frozenset[str]  # matched by exact name; empty: every model
    targets: tuple[RewriteTarget, ...]
    created: str  # the object's creationTimestamp (RFC 3339 text sorts by time)
    source: str  # the object's name

    def choose(self, draw: float) -> str:
        """The target for ``draw`` in [0, 1): weighted targets in proportion, else uniform."""
        weighted = [t for t in self.targets if t.weight is not None]
        if not weighted:
            return self.targets[min(int(draw * len(self.targets)), len(self.targets) - 1)].model
        total = sum(t.weight or 0 for t in weighted)
        point = draw * total
        for target in weighted:
            point -= target.weight or 0
            if point < 0:
                return target.model
        return weighted[-1].model


@dataclass(frozen=True, slots=True)
class InferenceObjects:
    """The objectives (name -> priority) and rewrite rules in force; immutable."""

    priorities: Mapping[str, int]
    exact: Mapping[str, RewriteRule]  # model -> the rule of highest precedence naming it
    generic: RewriteRule | None  # the oldest rule matching every model

    def rewrite(self, model: str, draw: Callable[[], float]) -> str | None:
        """The model ``model`` is routed as, or None when no rule matches it."""
        rule = self.exact.get(model) or self.generic
        return None if rule is None else rule.choose(draw())


NO_OBJECTS: Final = InferenceObjects(MappingProxyType({}), MappingProxyType({}), None)


def objective_of(obj: Mapping[str, Any], pool: str) -> tuple[str, int] | None:
    """``(name, priority)`` of an InferenceObjective of ``pool``; None for another pool's.

    Raises ``ValueError`` saying what is wrong with an object of this pool.
    """
    spec = _spec_of_pool(obj, pool)
    if spec is None:
        return None
    priority = spec.get("priority", 0)
    if priority is None:
        priority = 0
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError("spec.priority is not an integer")
    return _name(obj), priority


def rules_of(obj: Mapping[str, Any], pool: str) -> tuple[RewriteRule, ...] | None:
    """The rules of an InferenceModelRewrite of ``pool``; None for another pool's.

    Raises ``ValueError`` saying what is wrong with an object of this pool.
    """
    spec = _spec_of_pool(obj, pool)
    if spec is None:
        return None
    name = _name(obj)
    created = str((obj.get("metadata") or {}).get("creationTimestamp") or "")
    rules = spec.get("rules")
    if not isinstance(rules, list) or not rules:
        raise ValueError("spec.rules is missing or empty")
    read: list[RewriteRule] = []
    for index, rule in enumerate(rules):
        where = f"spec.rules[{index}]"
        if not isinstance(rule, Mapping):
            raise ValueError(f"{where} is not an object")
        models = frozenset(_matched_models(rule.get("matches") or [], where))
        targets = rule.get("targets")
        if not isinstance(targets, list) or not targets:
            raise ValueError(f"{where}.targets is missing or empty")
        read.append(RewriteRule(models, tuple(_targets(targets, where)), created, name))
    return tuple(read)


def combine(
    priorities: Mapping[str, int], rewrites: Mapping[str, tuple[RewriteRule, ...]]
) -> InferenceObjects:
    """One ``InferenceObjects`` from the objects read, with the rules' precedence applied."""
    ordered = sorted(rewrites.items(), key=lambda item: (_created(item[1]), item[0]))
    exact: dict[str, RewriteRule] = {}
    generic: RewriteRule | None = None
    for _, rules in ordered:  # oldest object first; its rules in list order
        for rule in rules:
            if not rule.models:
                generic = generic or rule
            for model in rule.models:
                exact.setdefault(model, rule)
    return InferenceObjects(MappingProxyType(dict(priorities)), MappingProxyType(exact), generic)


def _created(rules: tuple[RewriteRule, ...]) -> str:
    return rules[0].created if rules else ""


def _spec_of_pool(obj: Mapping[str, Any], pool: str) -> Mapping[str, Any] | None:
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise ValueError("it has no spec")
    reference = spec.get("poolRef")
    if not isinstance(reference, Mapping):
        raise ValueError("spec.poolRef is missing")
    group = reference.get("group") or POOL_GROUP
    if reference.get("name") != pool or group != POOL_GROUP:
        return None
    return spec


def _name(obj: Mapping[str, Any]) -> str:
    name = (obj.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("metadata.name is missing")
    return name


def _matched_models(matches: Any, where: str) -> list[str]:
    if not isinstance(matches, list):
        raise ValueError(f"{where}.matches is not a list")
    models: list[str] = []
    for index, match in enumerate(matches):
        model = match.get("model") if isinstance(match, Mapping) else None
        if not isinstance(model, Mapping):
            raise ValueError(f"{where}.matches[{index}].model is missing")
        kind = model.get("type") or "Exact"
        value = model.get("value")
        if kind != "Exact":
            raise ValueError(f"{where}.matches[{index}].model.type {kind!r} is not Exact")
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}.matches[{index}].model.value is not a model name")
        models.append(value)
    return models


def _targets(targets: list[Any], where: str) -> list[RewriteTarget]:
    read: list[RewriteTarget] = []
    for index, target in enumerate(targets):
        place = f"{where}.targets[{index}]"
        if not isinstance(target, Mapping):
            raise ValueError(f"{place} is not an object")
        model = target.get("modelRewrite")
        if not isinstance(model, str) or not model:
            raise ValueError(f"{place}.modelRewrite is not a model name")
        weight = target.get("weight")
        if weight is not None and (
            not isinstance(weight, int) or isinstance(weight, bool) or not 0 < weight <= MAX_WEIGHT
        ):
            raise ValueError(f"{place}.weight is not an integer in 1..{MAX_WEIGHT}")
        read.append(RewriteTarget(model, weight))
    return read


class InferenceObjectsFollower:
    """Follows both kinds for ``options.inference_pool``; ``current`` is what is in force."""

    def __init__(self, options: KubernetesOptions, configuration: Any) -> None:
        assert options.inference_pool is not None
        self.current: InferenceObjects = NO_OBJECTS
        self._options = options
        self._configuration = configuration
        self._lock = threading.Lock()  # the two watch threads' writes; reads take none
        self._priorities: Mapping[str, int] = {}
        self._rules: Mapping[str, tuple[RewriteRule, ...]] = {}

    def watches(self) -> tuple[ObjectsWatch, ObjectsWatch]:
        """Fresh watches of both kinds (a stopped Reflector does not run again)."""
        options, configuration = self._options, self._configuration
        return (
            ObjectsWatch(options, configuration, OBJECTIVES, self._objectives_changed),
            ObjectsWatch(options, configuration, REWRITES, self._rewrites_changed),
        )

    def _objectives_changed(self, objects: Mapping[str, Mapping[str, Any]]) -> None:
        pool = self._options.inference_pool or ""
        priorities: dict[str, int] = {}
        for name, obj in objects.items():
            read = _read(objective_of, obj, pool, "InferenceObjective", name)
            if read is not None:
                priorities[read[0]] = read[1]
        with self._lock:
            self._priorities = priorities
            self.current = combine(self._priorities, self._rules)

    def _rewrites_changed(self, objects: Mapping[str, Mapping[str, Any]]) -> None:
        pool = self._options.inference_pool or ""
        rules: dict[str, tuple[RewriteRule, ...]] = {}
        for name, obj in objects.items():
            read = _read(rules_of, obj, pool, "InferenceModelRewrite", name)
            if read is not None:
                rules[name] = read
        with self._lock:
            self._rules = rules
            self.current = combine(self._priorities, self._rules)


def _read(
    reader: Callable[[Mapping[str, Any], str], Any],
    obj: Mapping[str, Any],
    pool: str,
    kind: str,
    name: str,
) -> Any:
    try:
        return reader(obj, pool)
    except ValueError as error:
        # Logged on every change of the kind while it stays wrong: changes are rare.
        log.error("%s %r cannot be followed: %s; ignoring it", kind, name, error)
        return None


ObjectsChanged = Callable[[Mapping[str, Mapping[str, Any]]], None]


class ObjectsWatch(Reflector):
    """Lists and watches one kind (``plural``) in the pool's namespace; reports every change
    (every object of the kind: which name the pool is the follower's to sort out)."""

    def __init__(
        self,
        options: KubernetesOptions,
        configuration: Any,
        plural: str,
        changed: ObjectsChanged,
    ) -> None:
        super().__init__(options, configuration, self._refused)
        self.plural = plural
        self.label = f"{plural} watch"
        self._changed = changed
        self._objects: dict[str, Mapping[str, Any]] = {}
        self._group: str | None = None  # the group found serving the kind
        self._absent = False  # neither group serves it: look again later
        self._said_absent = False

    def _refused(self, error: tuple[PodIdentity, ...] | DiscoveryError) -> None:
        """A refusal or a failure to start (never pods): not followed, routing goes on."""
        log.error("%s: %s; routing goes on without them", self.label, error)

    def _client(self, api_client: Any) -> Any:
        from kubernetes import client  # noqa: PLC0415

        return client.CustomObjectsApi(api_client)

    def _where(self, namespace: str) -> str:
        return f"{self.plural} in namespace {namespace!r}"

    def _ready(self) -> bool:
        if not self._absent:
            return True
        self._wake.wait(self._options.retry_max)
        self._wake.clear()
        self._absent = False
        return False

    def _list(self, api: Any, namespace: str) -> None:
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        for group in GROUPS:
            try:
                document = self._list_group(api, group, namespace)
            except ApiException as error:
                if error.status == 404:  # the kind is not served in this group
                    continue
                raise
            self._group = group
            self._objects = {
                item["metadata"]["name"]: item
                for item in document["items"]
                if isinstance(item, Mapping)
                and isinstance((item.get("metadata") or {}).get("name"), str)
            }
            self._version = document["version"]
            self._started = True
            self._absent = self._said_absent = False
            self._changed(dict(self._objects))
            return
        if not self._said_absent:
            log.info(
                "%s: not served in %s (no CRD installed): none followed; looking again "
                "every %.0f s",
                self.label,
                " or ".join(f"{g}/{VERSION}" for g in GROUPS),
                self._options.retry_max,
            )
            self._said_absent = True
        self._absent = True
        self._started = True  # its absence is not a refusal

    def _list_group(self, api: Any, group: str, namespace: str) -> dict[str, Any]:
        items: list[Any] = []
        token: str | None = None
        while True:
            response = api.list_namespaced_custom_object(
                group,
                VERSION,
                namespace,
                self.plural,
                limit=self._options.page_size,
                _continue=token,
                _preload_content=False,
                _request_timeout=self._options.request_timeout,
            )
            with self._tracking(response):
                document = json.loads(response.read())
            items.extend(document.get("items") or ())
            metadata = document.get("metadata") or {}
            token = metadata.get("continue") or None
            if token is None:
                version = metadata.get("resourceVersion")
                if not version:
                    raise ValueError(f"the {self.plural} list carries no resourceVersion")
                return {"items": items, "version": str(version)}

    def _watch(self, api: Any, namespace: str) -> None:
        if self._absent or self._group is None:
            return
        self._watch_from_version(
            api.list_namespaced_custom_object, self._group, VERSION, namespace, self.plural
        )

    def _handle(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "BOOKMARK":
            return
        name = (obj.get("metadata") or {}).get("name")
        if not isinstance(name, str) or not name:
            return
        if kind == "DELETED" or (obj.get("metadata") or {}).get("deletionTimestamp"):
            if self._objects.pop(name, None) is None:
                return
        else:
            self._objects[name] = obj
        self._changed(dict(self._objects))
