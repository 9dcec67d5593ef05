"""Pods and requests written by hand, for ``policyd explain`` and ``policyd test``.

Both read YAML (JSON is read the same way), so a mistake in a snapshot or a
test case is reported as ``file:line:col`` like a mistake in a policy. Pods are
``StaticPod`` objects, generated from the pod field declarations
(``policyd.policy.pods``); the policy room does not import the pool room.
"""

from __future__ import annotations

from typing import Any

from policyd.cel import Duration
from policyd.fields import POD_FIELDS, REQUEST_FIELDS
from policyd.fields.roles import role_named, role_of
from policyd.policy.diagnostics import Diagnostic
from policyd.policy.pods import StaticPod
from policyd.policy.reader import Fields, is_number, scalar_value
from policyd.policy.request import Request
from policyd.policy.source import YMapping, YNode, YScalar, YSequence, kind_name

# StaticPod is generated into pods.py; `policyd test` imports it from here, with its reader.
__all__ = ["DEFAULT_PORT", "StaticPod", "read_pods", "read_request"]

DEFAULT_PORT = 8000


_POD_KINDS = {f.name: f.kind for f in POD_FIELDS}
_REQUEST_KINDS = {f.name: f.kind for f in REQUEST_FIELDS}
_DECIDED_BY_POLICY = tuple(f.name for f in REQUEST_FIELDS if f.origin == "policy")


def read_pods(node: YNode, diagnostics: list[Diagnostic]) -> tuple[StaticPod, ...]:
    """Pods from ``{name: {fields}}``, ``[{name: ..., ...}]`` or ``{pods: [...]}``.

    ``address`` defaults to ``<name>:8000``; ``role`` to what the pod's
    ``llm-d.ai/role`` label says; other fields default to an idle pod.
    """
    if isinstance(node, YMapping) and set(node.entries) == {"pods"}:
        node = node.entries["pods"][1]
    entries: list[tuple[str | None, YNode]] = []
    if isinstance(node, YMapping):
        entries = [(name, value) for name, (_, value) in node.entries.items()]
    elif isinstance(node, YSequence):
        entries = [(None, item) for item in node.items]
    else:
        diagnostics.append(
            node.source.diagnostic(
                node.at, f"pods must be a mapping or a list, not {kind_name(node)}"
            )
        )
        return ()
    pods: list[StaticPod] = []
    seen: set[str] = set()
    for name, value in entries:
        pod = _read_pod(name, value, diagnostics)
        if pod is None:
            continue
        if pod.name in seen:
            diagnostics.append(
                value.source.diagnostic(value.at, f"pod '{pod.name}' is listed twice")
            )
            continue
        seen.add(pod.name)
        pods.append(pod)
    return tuple(pods)


def _read_pod(name: str | None, node: YNode, diagnostics: list[Diagnostic]) -> StaticPod | None:
    if not isinstance(node, YMapping):
        if isinstance(node, YScalar) and node.value is None and name is not None:
            return StaticPod(name, f"{name}:{DEFAULT_PORT}")  # `pod-a:` alone: an idle pod
        diagnostics.append(
            node.source.diagnostic(node.at, f"a pod must be a mapping, not {kind_name(node)}")
        )
        return None
    fields = Fields(node, _POD_KINDS, diagnostics, what="a pod")
    values: dict[str, Any] = {}
    for key, (_, value) in node.entries.items():
        if key in _POD_KINDS:
            converted = _convert(_POD_KINDS[key], value)
            if isinstance(converted, str):
                fields.error(
                    value, f"pod field '{key}' must be {converted}, not {kind_name(value)}"
                )
            else:
                values[key] = converted[0]
    if name is not None:
        values.setdefault("name", name)
    if "name" not in values:
        fields.error(node, "a pod needs a 'name'")
        return None
    values.setdefault("address", f"{values['name']}:{DEFAULT_PORT}")
    # As the pool gives it: a `role` written out, else the llm-d role label's.
    values["role"] = (
        role_named(values["role"]) if "role" in values else role_of(values.get("labels", {}))
    )
    return StaticPod(**values)


def read_request(node: YNode, diagnostics: list[Diagnostic]) -> Request | None:
    """A request from its CEL fields; ``target_model`` and ``criticality`` are refused
    because the policy decides them (set the criticality header instead)."""
    if not isinstance(node, YMapping):
        diagnostics.append(
            node.source.diagnostic(node.at, f"a request must be a mapping, not {kind_name(node)}")
        )
        return None
    fields = Fields(node, _REQUEST_KINDS, diagnostics, what="a request")
    values: dict[str, Any] = {}
    for key, (key_node, value) in node.entries.items():
        if key in _DECIDED_BY_POLICY:
            fields.error(
                key_node,
                f"'{key}' is decided by the policy (criticality from the "
                "x-gateway-inference-criticality header or the model; target_model from "
                "the model's targets)",
            )
        elif key in _REQUEST_KINDS:
            converted = _convert(_REQUEST_KINDS[key], value)
            if isinstance(converted, str):
                fields.error(
                    value, f"request field '{key}' must be {converted}, not {kind_name(value)}"
                )
            else:
                values[key] = converted[0]
    if "model" not in values:
        fields.error(node, "a request needs a 'model'")
        return None
    if "headers" in values:
        values["headers"] = {k.lower(): v for k, v in values["headers"].items()}
    return Request(**values)


def _convert(kind: str, node: YNode) -> tuple[Any] | str:
    """``(value,)`` of a schema kind, or what the value should have been."""
    if kind == "list<string>":
        if isinstance(node, YSequence) and all(
            isinstance(i, YScalar) and isinstance(i.value, str) for i in node.items
        ):
            return (tuple(str(i.value) for i in node.items if isinstance(i, YScalar)),)
        return "a list of strings"
    if kind == "map<string,string>":
        if isinstance(node, YMapping) and all(
            isinstance(v, YScalar) and isinstance(v.value, str | int | float)
            for _, v in node.entries.values()
        ):
            return (
                {k: str(v.value) for k, (_, v) in node.entries.items() if isinstance(v, YScalar)},
            )
        return "a mapping of strings"
    value = node.value if isinstance(node, YScalar) else None
    if kind == "duration" and is_number(value):  # hand-written pods give ages in seconds
        return (Duration.from_seconds(float(value)),)  # type: ignore[arg-type]
    converted = scalar_value(kind, value)
    if converted is not None:
        return converted
    return {
        "duration": "seconds or a duration like 250ms",
        "string": "a string",
        "int": "an integer",
        "double": "a number",
        "bool": "true or false",
    }[kind]
