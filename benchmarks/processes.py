"""The benchmarks' view of local processes: a port to wait for, CPU seconds from /proc.

The load benchmarks start pods, policyd and Envoy as processes of their own
and charge each its CPU; they read it here, the same way (Linux only).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    """Returns once something accepts connections on loopback ``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port} after {timeout}s")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    return _cpu_seconds(_stat_fields(Path(f"/proc/{pid}/stat")))


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle so far (Linux /proc/stat)."""
    ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds(parent: int) -> dict[int, float]:
    """CPU seconds so far of each running child process of ``parent`` (Linux /proc)."""
    found: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = _stat_fields(entry / "stat")
            if int(fields[1]) == parent:
                found[int(entry.name)] = _cpu_seconds(fields)
    return found


def _stat_fields(stat: Path) -> list[str]:
    """The fields of a /proc/<pid>/stat after the command name (which may hold spaces)."""
    return stat.read_text().rpartition(")")[2].split()


def _cpu_seconds(fields: list[str]) -> float:
    """utime + stime of ``_stat_fields``, in seconds."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
