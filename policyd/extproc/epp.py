"""The Gateway API Inference Extension's endpoint-picker protocol: what a proxy sends.

The protocol is proposal 004 of kubernetes-sigs/gateway-api-inference-extension
(``docs/proposals/004-endpoint-picker-protocol/README.md``, version 1.0.0 of
2025-07-29). What policyd answers (the destination header, the same value in
``envoy.lb`` dynamic metadata, fallbacks after it, comma separated) is in
``replies``; this module reads the two things the proxy may send:

- **The endpoint subset** (request): the proxy MAY put, in the ext_proc
  request's metadata, the namespace ``envoy.lb.subset_hint`` with the key
  ``x-gateway-destination-endpoint-subset``: a list of ``ip:port``. When the
  key is there the picker MUST choose only among those endpoints, and answer
  503 when none of them is eligible or the list is empty; without it, it
  chooses from the whole pool. policyd narrows the candidates it hands the
  router (:class:`Subsets`), so every policy honours it without knowing of it.
  An entry without a port matches the pod's IP (the reference picker compares
  IPs only, ``pkg/epp/scheduling/framework/plugins/filter/subset_filter.go``);
  a value that is a single string is read as a comma-separated list, and an
  empty map as the empty list (Envoy's Lua filter makes an empty table one).
- **The endpoint that served** (response): the proxy MUST tell the picker,
  in the response's metadata, namespace ``envoy.lb`` key
  ``x-gateway-destination-endpoint-served``, which endpoint answered, since
  with fallbacks and retries it need not be the first one named. policyd
  reads it at the response headers and moves the request's in-flight count
  to that pod (``Exchange``). Envoy does not set it by itself; a gateway that
  does (GKE's) gets exact counts, and without it the count stays on the pick.

Envoy forwards a metadata namespace to the picker only when its ext_proc
filter lists it in ``metadata_options.forwarding_namespaces.untyped``
(``policyd envoy-config --ext-proc-mode inference-pool`` lists both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from google.protobuf import struct_pb2

from policyd.extproc.errors import RequestError
from policyd.extproc.replies import DESTINATION_HEADER, LB_METADATA_NAMESPACE
from policyd.pool.pod import Pod

SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET_KEY: Final = "x-gateway-destination-endpoint-subset"
SERVED_KEY: Final = DESTINATION_HEADER + "-served"


def subset_hint(message: Any) -> tuple[str, ...] | None:
    """The endpoint subset in a ``ProcessingRequest``'s metadata, or None when it has none.

    Raises a 503 ``RequestError`` for a subset that is neither a list of
    strings nor a string: the proxy named a subset policyd cannot read, and
    choosing outside it is what the protocol forbids.
    """
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        entries = []
        for item in value.list_value.values:
            if item.WhichOneof("kind") != "string_value":
                raise _unreadable(item)
            entries.append(item.string_value.strip())
        return tuple(entry for entry in entries if entry)
    if kind == "string_value":
        return tuple(part.strip() for part in value.string_value.split(",") if part.strip())
    if kind == "struct_value" and not value.struct_value.fields:
        return ()  # an empty list where the proxy cannot tell one from a map (Envoy's Lua)
    raise _unreadable(value)


def _unreadable(value: struct_pb2.Value) -> RequestError:
    return RequestError(
        503,
        f"the proxy's endpoint subset ({SUBSET_NAMESPACE}/{SUBSET_KEY}) is not a list of "
        f"ip:port strings (it holds a {value.WhichOneof('kind') or 'null'})",
        "bad_endpoint_subset",
    )


def served_endpoint(message: Any) -> str:
    """The endpoint the proxy says served the response (``ip:port``), or ``""``."""
    namespace = message.metadata_context.filter_metadata.get(LB_METADATA_NAMESPACE)
    if namespace is None or SERVED_KEY not in namespace.fields:
        return ""
    value = namespace.fields[SERVED_KEY]
    return value.string_value.strip() if value.WhichOneof("kind") == "string_value" else ""


class Subsets:
    """The candidates narrowed to a proxy's subset, kept per subset and candidates tuple.

    A gateway that sends subsets tends to send the same few again and again;
    handing the router the same narrowed tuple for the same subset of the same
    snapshot keeps its reuse of filter-tree walks (which is keyed on the
    candidates tuple). Used from the event loop only; emptied when it holds
    ``limit`` subsets.
    """

    __slots__ = ("_kept", "_limit")

    def __init__(self, limit: int = 256) -> None:
        self._limit = limit
        self._kept: dict[tuple[str, ...], tuple[Sequence[Pod], tuple[Pod, ...]]] = {}

    def narrow(self, candidates: Sequence[Pod], subset: tuple[str, ...]) -> tuple[Pod, ...]:
        """The candidates in ``subset``, in candidate order; a 503 when there are none."""
        kept = self._kept.get(subset)
        if kept is not None and kept[0] is candidates:
            narrowed = kept[1]
        else:
            wanted = frozenset(subset)
            narrowed = tuple(
                pod
                for pod in candidates
                if pod.address in wanted or pod.address.rpartition(":")[0] in wanted
            )
            if len(self._kept) >= self._limit:
                self._kept.clear()
            self._kept[subset] = (candidates, narrowed)
        if not narrowed:
            raise RequestError(
                503,
                "none of the endpoints in the proxy's subset is a ready pod of the pool"
                if subset
                else "the proxy's endpoint subset is empty",
                "no_subset_endpoints",
            )
        return narrowed
