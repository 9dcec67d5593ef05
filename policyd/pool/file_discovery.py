"""Pods listed in a YAML file, watched for changes.

```yaml
pods:
  - name: vllm-0
    address: 10.0.0.11:8000          # ip:port Envoy sends requests to
    labels: {model: llama-3-8b}       # optional, string values
    role: decode                      # optional: else from the role label (pod.role)
  - name: vllm-1
    address: "[fd00::12]:8000"
```

The file takes the shapes ``policyd explain --pods`` and ``policyd test``
take, so one file serves both: the list under ``pods``, the list alone, or a
mapping from pod name to its fields. The other declared ``pod`` fields
(``waiting_queue``, ``kv_cache``, ...) a snapshot for ``explain`` carries are
scraped from the pods here: they are ignored, logged once per read, while an
undeclared key (a typo such as ``adress``) is still an error.

The file is read every poll interval (in a worker thread) and compared with
the last read: comparing contents rather than modification times also
catches same-size edits within one timestamp tick and the symlink swap of a
mounted ConfigMap, and a pod file is small enough to read once a second.
A file that is missing or invalid at start is an error; a later bad edit is
rejected with the file, line and reason, logged, kept in ``last_error``, and
the last good pod set stays in force.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import yaml

from policyd.fields.declared import POD_FIELDS
from policyd.fields.roles import role_named
from policyd.pool.discovery import DiscoveryError, PodIdentity, split_address

log = logging.getLogger(__name__)

_NULL_TAG = "tag:yaml.org,2002:null"
_IDENTITY_KEYS = ("name", "address", "labels", "role")
# What an ``explain`` snapshot may say about a pod beyond its identity: the
# pool measures these itself.
_MEASURED_KEYS = tuple(f.name for f in POD_FIELDS if f.name not in _IDENTITY_KEYS)


class StaticFileDiscovery:
    """A ``Discovery`` source reading pods from a YAML file."""

    def __init__(self, path: Path | str, *, poll_interval: float = 1.0) -> None:
        if poll_interval <= 0:
            raise ValueError(f"poll interval must be positive, not {poll_interval}")
        self.path = Path(path)
        self.poll_interval = poll_interval
        self.last_error: DiscoveryError | None = None

    async def updates(self) -> AsyncIterator[tuple[PodIdentity, ...]]:
        source = str(self.path)
        try:
            data = await asyncio.to_thread(self.path.read_bytes)
        except OSError as error:
            raise DiscoveryError(
                f"cannot read the pod file: {error.strerror}", source=source
            ) from None
        pods = parse_pod_file(data, source)
        log.info("loaded %d pods from %s", len(pods), source)
        yield pods
        unreadable = False
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                new_data = await asyncio.to_thread(self.path.read_bytes)
            except OSError as error:
                if not unreadable:
                    log.warning(
                        "cannot read the pod file %s (%s); keeping the last %d pods",
                        source,
                        error.strerror,
                        len(pods),
                    )
                unreadable = True
                continue
            unreadable = False
            if new_data == data:
                continue
            data = new_data
            try:
                new_pods = parse_pod_file(data, source)
            except DiscoveryError as error:
                self.last_error = error
                log.error(
                    "rejected a change to the pod file: %s; keeping the last %d pods",
                    error,
                    len(pods),
                )
                continue
            self.last_error = None
            if new_pods != pods:
                pods = new_pods
                log.info("pod file %s changed: %d pods", source, len(pods))
                yield pods


def parse_pod_file(data: bytes | str, source: str) -> tuple[PodIdentity, ...]:
    """The pods a pod file lists, sorted by name; ``DiscoveryError`` names the line at fault."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            line = data.count(b"\n", 0, error.start) + 1
            raise DiscoveryError("the file is not UTF-8 text", source=source, line=line) from None
    else:
        text = data
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        raise DiscoveryError(
            f"not valid YAML: {error.problem or error.context}",
            source=source,
            line=None if mark is None else mark.line + 1,
        ) from None
    except yaml.YAMLError as error:
        raise DiscoveryError(f"not valid YAML: {error}", source=source) from None
    if root is None:
        raise DiscoveryError(
            "the file is empty; expected 'pods:' with a list of pods", source=source, line=1
        )
    entries = _pod_entries(root, source)
    ignored: set[str] = set()
    pods = [_pod(name, node, source, ignored) for name, node in entries]
    _reject_duplicates(pods, [node for _, node in entries], source)
    if ignored:  # read once per change of the file, so logged once per change
        log.warning(
            "%s: ignoring %s: the pool scrapes them from the pods (they are for explain and test)",
            source,
            ", ".join(sorted(ignored)),
        )
    return tuple(sorted(pods, key=lambda pod: pod.name))


def _pod_entries(root: yaml.Node, source: str) -> list[tuple[str | None, yaml.Node]]:
    """``(name from the key, pod node)`` for each shape: ``pods:`` list, list, name mapping."""
    if isinstance(root, yaml.MappingNode) and [_key(k) for k, _ in root.value] == ["pods"]:
        root = root.value[0][1]
        if not isinstance(root, yaml.SequenceNode):
            raise DiscoveryError("'pods' must be a list", source=source, line=_line(root))
    if isinstance(root, yaml.SequenceNode):
        return [(None, node) for node in root.value]
    if isinstance(root, yaml.MappingNode):
        return [(_text(key, "pod name", source), node) for key, node in root.value]
    raise DiscoveryError(
        "expected 'pods:' with a list of pods, a list, or a mapping from pod name to its fields",
        source=source,
        line=_line(root),
    )


def _key(node: yaml.Node) -> str | None:
    return str(node.value) if isinstance(node, yaml.ScalarNode) else None


def _pod(name: str | None, node: yaml.Node, source: str, ignored: set[str]) -> PodIdentity:
    fields = _mapping(node, "a pod", (*_IDENTITY_KEYS, *_MEASURED_KEYS), source)
    ignored.update(key for key in fields if key in _MEASURED_KEYS)
    if name is not None:
        if "name" in fields and _text(fields["name"], "name", source) != name:
            raise DiscoveryError(
                f"the pod listed as {name!r} is named {_text(fields['name'], 'name', source)!r}",
                source=source,
                line=_line(fields["name"]),
            )
    elif "name" not in fields:
        raise DiscoveryError("the pod has no 'name'", source=source, line=_line(node))
    else:
        name = _text(fields["name"], "name", source)
    if "address" not in fields:
        raise DiscoveryError(
            "the pod has no 'address' (ip:port; explain's default <name>:8000 is no address)",
            source=source,
            line=_line(node),
        )
    address = _text(fields["address"], "address", source)
    try:
        split_address(address)
    except ValueError as error:
        raise DiscoveryError(str(error), source=source, line=_line(fields["address"])) from None
    labels: dict[str, str] = {}
    if "labels" in fields:
        label_nodes = _mapping(fields["labels"], "labels", None, source)
        for key, value in label_nodes.items():
            labels[key] = _text(value, f"label {key!r}", source, allow_empty=True)
    role = _text(fields["role"], "role", source) if "role" in fields else ""
    return PodIdentity.of(name, address, labels, role_named(role) if role else "")


def _mapping(
    node: yaml.Node, what: str, allowed: tuple[str, ...] | None, source: str
) -> dict[str, yaml.Node]:
    """A mapping node's entries by key; unknown or repeated keys are errors."""
    if not isinstance(node, yaml.MappingNode):
        raise DiscoveryError(f"{what} must be a mapping", source=source, line=_line(node))
    entries: dict[str, yaml.Node] = {}
    for key_node, value_node in node.value:
        key = _text(key_node, "key", source)
        if allowed is not None and key not in allowed:
            raise DiscoveryError(
                f"unknown key {key!r} in {what} (expected {', '.join(allowed)})",
                source=source,
                line=_line(key_node),
            )
        if key in entries:
            raise DiscoveryError(
                f"{key!r} appears twice in {what}", source=source, line=_line(key_node)
            )
        entries[key] = value_node
    return entries


def _text(node: yaml.Node, what: str, source: str, *, allow_empty: bool = False) -> str:
    if not isinstance(node, yaml.ScalarNode) or (node.tag == _NULL_TAG and not allow_empty):
        raise DiscoveryError(f"{what} must be a plain value", source=source, line=_line(node))
    value = str(node.value) if node.tag != _NULL_TAG else ""
    if not value and not allow_empty:
        raise DiscoveryError(f"{what} is empty", source=source, line=_line(node))
    return value


def _reject_duplicates(pods: list[PodIdentity], nodes: list[yaml.Node], source: str) -> None:
    seen_names: set[str] = set()
    seen_addresses: set[str] = set()
    for pod, pod_node in zip(pods, nodes, strict=True):
        if pod.name in seen_names:
            raise DiscoveryError(
                f"pod name {pod.name!r} is used twice", source=source, line=_line(pod_node)
            )
        if pod.address in seen_addresses:
            raise DiscoveryError(
                f"address {pod.address} is used twice", source=source, line=_line(pod_node)
            )
        seen_names.add(pod.name)
        seen_addresses.add(pod.address)


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1
