"""What every part of policyd's Envoy bootstrap spells the same way: the type URL
of a typed config, a socket address, whether a host is an IP address (a STATIC
cluster) or a name (STRICT_DNS)."""

from __future__ import annotations

import ipaddress
from typing import Any, Final

TYPE_URL: Final = "type.googleapis.com/"


def socket_address(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
