"""``policyd demo`` as a user runs it: a separate process, real Envoy, real sockets."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DECISION = re.compile(r"^(r\d{3})\s+(\S+)\s+(crit|std|shed)\s+(vllm-\d)\s+(\d{3})\s")
ADMIN = re.compile(r"admin 127\.0\.0\.1:(\d+)\)\s+-> policyd 127\.0\.0\.1:(\d+)")


def demo(*arguments: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "policyd", "demo", "--plain", *arguments],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def test_a_short_burst_routes_every_request_to_a_simulated_pod_and_exits_cleanly() -> None:
    process = demo("--requests", "12", "--rate", "20")
    out, err = process.communicate(timeout=90)
    assert process.returncode == 0, err
    decisions = [m for line in out.splitlines() if (m := DECISION.match(line))]
    assert sorted(m.group(1) for m in decisions) == [f"r{i:03d}" for i in range(1, 13)]
    assert {m.group(5) for m in decisions} == {"200"}
    # The "why" column names the seed policy's filter nodes or its random pick.
    assert all(
        ("random of" in line or "only one left" in line)
        for line in out.splitlines()
        if DECISION.match(line)
    )
    assert "summary: 12 requests" in out
    assert "answers   200 x12" in out
    routed = re.search(r"per pod\s+(.*)", out)
    assert routed is not None
    per_pod = dict(re.findall(r"(vllm-\d) (\d+)", routed.group(1)))
    assert sorted(per_pod) == [f"vllm-{i}" for i in range(6)]
    assert sum(int(n) for n in per_pod.values()) == 12
    ports = ADMIN.search(out)
    assert ports is not None
    assert all(refuses_connections(int(port)) for port in ports.groups())


def test_ctrl_c_stops_the_demo_and_everything_it_started() -> None:
    process = demo("--continuous", "--rate", "20")
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, "the demo ended before routing a request"
            lines.append(line)
            if DECISION.match(line):
                break
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err
    assert "interrupted; everything is stopped" in out
    ports = ADMIN.search("".join(lines))
    assert ports is not None
    assert all(refuses_connections(int(port)) for port in ports.groups())
