"""Following one InferencePool (``inference.networking.k8s.io/v1``): which pods, which ports.

The Gateway API Inference Extension's InferencePool names the model-server
pods of a pool by ``spec.selector.matchLabels`` (pods of its own namespace)
and the ports they serve on by ``spec.targetPorts[*].number``. ``PoolWatch``
gets the pool, then watches it (a watch narrowed to its name by the field
selector ``metadata.name=NAME``, so a Role may grant ``get`` and ``watch`` on
that one pool by ``resourceNames``), and hands each new ``PodSelection`` to
the pod watch.

What it does with trouble, as a service that must keep routing would:

- A pool that is not there yet (at start, 404 naming the pool) is waited
  for, logged; policyd has no pods, so it is not ready, until it appears.
  The pool's resource itself not being served (the CRD is not installed), or
  ``401`` / ``403``, is an error at start.
- A pool object policyd cannot use (no selector, a selector it does not
  understand, no or bad target ports) is logged and ignored: the last good
  selection stays in force.
- A deleted pool keeps the last selection, logged: policyd goes on following
  the pods its last spec selected, and takes the new spec when the pool is
  created again. Deleting the pool already makes the gateway stop sending its
  requests (the HTTPRoute's backend is gone), so emptying the pod set would
  protect nothing, while keeping it rides out a delete and re-create (a
  ``kubectl replace --force``, a re-install) without a window of 503s. The
  reference endpoint picker clears its pods instead; ``docs/deployment.md``
  says so.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from policyd.pool.kubernetes_watch import Delivery, KubernetesOptions, PodSelection, Reflector

log = logging.getLogger(__name__)

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"

# Label syntax as the API server validates it: an optional DNS-subdomain
# prefix and a name of at most 63 characters; values alike, or empty.
_LABEL_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"
_LABEL_KEY = re.compile(
    rf"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}"
)
_LABEL_VALUE = re.compile(rf"({_LABEL_NAME})?")


def selection_of(pool: Mapping[str, Any]) -> PodSelection:
    """The pods and ports an InferencePool object names.

    Raises ``ValueError`` saying what is wrong with an object policyd cannot
    follow.
    """
    spec = pool.get("spec")
    if not isinstance(spec, Mapping):
        raise ValueError("it has no spec")
    selector = spec.get("selector")
    if not isinstance(selector, Mapping):
        raise ValueError("spec.selector is missing")
    other = sorted(set(selector) - {"matchLabels"})
    if other:  # a later API version's selector kinds would select more pods than meant
        raise ValueError(f"spec.selector.{other[0]} is not understood (only matchLabels)")
    labels = selector.get("matchLabels")
    if not isinstance(labels, Mapping) or not labels:
        raise ValueError("spec.selector.matchLabels is missing or empty")
    for key, value in labels.items():
        if not isinstance(key, str) or len(key) > 253 + 1 + 63 or not _LABEL_KEY.fullmatch(key):
            raise ValueError(f"spec.selector.matchLabels: {key!r} is not a label name")
        if not isinstance(value, str) or not _LABEL_VALUE.fullmatch(value):
            raise ValueError(f"spec.selector.matchLabels[{key!r}]: {value!r} is not a label value")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not ports:
        raise ValueError("spec.targetPorts is missing or empty")
    numbers = []
    for index, port in enumerate(ports):
        number = port.get("number") if isinstance(port, Mapping) else None
        if not isinstance(number, int) or isinstance(number, bool):
            raise ValueError(f"spec.targetPorts[{index}].number is not a number")
        numbers.append(number)
    try:
        return PodSelection(",".join(f"{k}={v}" for k, v in sorted(labels.items())), tuple(numbers))
    except ValueError as error:
        raise ValueError(f"spec.targetPorts: {error}") from None


class PoolWatch(Reflector):
    """Gets and watches the InferencePool ``options.inference_pool``; calls ``on_selection``.

    ``on_selection`` gets the first good selection and every different one
    after it (on this thread).
    """

    label = "InferencePool watch"

    def __init__(
        self,
        options: KubernetesOptions,
        configuration: Any,
        deliver: Delivery,
        on_selection: Callable[[PodSelection], None],
    ) -> None:
        super().__init__(options, configuration, deliver)
        assert options.inference_pool is not None
        self._name = options.inference_pool
        self._on_selection = on_selection
        self._selection: PodSelection | None = None
        self._present: bool | None = None  # None until the first get answered
        self._namespace = ""

    def _client(self, api_client: Any) -> Any:
        from kubernetes import client  # noqa: PLC0415

        return client.CustomObjectsApi(api_client)

    def _where(self, namespace: str) -> str:
        return f"InferencePool {self._name!r} in namespace {namespace!r}"

    def _refusal(self, namespace: str, error: Any) -> str:
        message = (
            f"the Kubernetes API refused to get {self._where(namespace)}: "
            f"HTTP {error.status} {error.reason}"
        )
        if error.status == 404:  # not the pool (that is waited for): its resource
            message += f" ({PLURAL}.{GROUP}/{VERSION} is not served: is its CRD installed?)"
        return message

    def _list(self, api: Any, namespace: str) -> None:
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        self._namespace = namespace
        try:
            response = api.get_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                self._name,
                _preload_content=False,
                _request_timeout=self._options.request_timeout,
            )
        except ApiException as error:
            if error.status != 404 or not self._names_the_pool(error):
                raise
            self._absent(namespace)
            self._version = None  # the watch starts at the newest version
            self._started = True
            return
        with self._tracking(response):
            pool = json.loads(response.read())
        self._started = True
        self._apply(pool, namespace)
        version = (pool.get("metadata") or {}).get("resourceVersion")
        if not version:
            raise ValueError("the InferencePool carries no resourceVersion")
        self._version = str(version)

    def _watch(self, api: Any, namespace: str) -> None:
        self._namespace = namespace
        self._watch_from_version(
            api.list_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            field_selector=f"metadata.name={self._name}",
        )

    def _handle(self, kind: str, obj: dict[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED"):
            self._apply(obj, self._namespace)
        elif kind == "DELETED":
            self._absent(self._namespace)

    def _apply(self, pool: Mapping[str, Any], namespace: str) -> None:
        where = self._where(namespace)
        if (pool.get("metadata") or {}).get("deletionTimestamp"):
            self._absent(namespace)
            return
        if self._present is False:
            log.info("%s exists again", where)
        self._present = True
        try:
            selection = selection_of(pool)
        except ValueError as error:
            if self._selection is None:
                log.error("%s cannot be followed: %s; waiting for a usable spec", where, error)
            else:
                log.error(
                    "%s cannot be followed: %s; keeping pods matching %s on ports %s",
                    where,
                    error,
                    self._selection.selector,
                    list(self._selection.ports),
                )
            return
        if selection == self._selection:
            return
        log.info(
            "%s: pods matching %s on ports %s",
            where,
            selection.selector,
            list(selection.ports),
        )
        self._selection = selection
        self._on_selection(selection)

    def _absent(self, namespace: str) -> None:
        if self._present is False:
            return  # said once
        where = self._where(namespace)
        if self._selection is None:
            log.warning("%s does not exist; waiting for it", where)
        else:
            log.warning(
                "%s was deleted; following pods matching %s on ports %s until it is back",
                where,
                self._selection.selector,
                list(self._selection.ports),
            )
        self._present = False

    def _names_the_pool(self, error: Any) -> bool:
        """Whether a 404 is about the pool object (not its resource being unknown)."""
        try:
            status = json.loads(error.body or "{}")
        except (TypeError, ValueError):
            return False
        details = status.get("details") if isinstance(status, dict) else None
        return isinstance(details, dict) and details.get("name") == self._name
