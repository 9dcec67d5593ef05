"""What every pod source gives the pool: the current set of pod identities.

A source is anything with an ``updates()`` async iterator that yields the
*whole* current set each time it changes (never a diff), so a consumer that
misses an update loses nothing: the next one is complete again. Two sources
ship: a watched YAML file (``file_discovery``) and a Kubernetes list + watch
(``kubernetes_discovery``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol


@dataclass(frozen=True, slots=True)
class PodIdentity:
    """Who a pod is: its name, the ``ip:port`` Envoy sends requests to, its labels.

    ``labels`` is read-only so that one identity can be shared by every
    snapshot that carries the pod without copying it. ``role`` is the pod's
    role as its source states it outright (a pod file's ``role:``); "" leaves
    it to the role label (``policyd.fields.roles``), as Kubernetes pods do.
    """

    name: str
    address: str
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    role: str = ""

    @classmethod
    def of(
        cls, name: str, address: str, labels: Mapping[str, str] | None = None, role: str = ""
    ) -> PodIdentity:
        """An identity with its labels frozen (a copy the caller cannot change)."""
        return cls(name, address, MappingProxyType(dict(labels or {})), role)


class Discovery(Protocol):
    """A source of pod identities.

    ``updates()`` yields the complete current set (sorted by name) first when
    it is known and then after every change. An error that makes the source
    useless from the start (a missing file, no permission to list pods) is
    raised from the first ``__anext__``; later trouble is logged and ridden
    out while the last good set stays in force. Closing the iterator stops
    whatever the source runs in the background.
    """

    def updates(self) -> AsyncIterator[tuple[PodIdentity, ...]]: ...


class DiscoveryError(Exception):
    """A pod source cannot produce a pod set; ``str()`` says where and why."""

    def __init__(self, reason: str, *, source: str = "", line: int | None = None) -> None:
        place = f"{source}:{line}: " if line is not None else (f"{source}: " if source else "")
        super().__init__(f"{place}{reason}")
        self.reason = reason
        self.source = source
        self.line = line


def split_address(address: str) -> tuple[str, int]:
    """``"10.0.0.1:8000"`` -> ``("10.0.0.1", 8000)``; ``"[fd00::1]:8000"`` -> ``("fd00::1", 8000)``.

    The host must be an IP literal: Envoy's ORIGINAL_DST cluster connects to
    the address in the destination header as is and resolves no names.
    Raises ``ValueError`` with a message fit for an operator.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"address {address!r} is not ip:port")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"address {address!r}: {host!r} is not an IP address") from None
    if ip.version == 6 and not bracketed:
        raise ValueError(f"address {address!r}: write an IPv6 address as [ip]:port")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"address {address!r}: port must be a number from 1 to 65535")
    return host, int(port_text)


def join_address(ip: str, port: int) -> str:
    """The ``ip:port`` form of an address (IPv6 in brackets)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
