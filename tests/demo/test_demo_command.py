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
PREFIX = re.compile(r" (\d\.\d\d)  \S")  # the pfx column: two spaces before the why
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


def refuses_connections(port: int, within: float = 3.0) -> bool:
    """True once nothing listens on ``port`` (an Envoy the demo stopped may take a moment)."""
    deadline = time.monotonic() + within
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def figures(out: str) -> dict[str, list[str]]:
    """The side-by-side's rows: label -> its cells (values, then the comparison)."""
    table = out[out.index("what policyd gained") :].splitlines()[2:8]
    return {line[:26].strip(): line[26:].split() for line in table}


def test_a_burst_routes_every_request_and_beats_random_routing_on_the_same_traffic() -> None:
    process = demo("--requests", "80", "--rate", "40", "--time-scale", "10")
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    main = out[: out.index("replaying the same 80 requests")]
    decisions = [m for line in main.splitlines() if (m := DECISION.match(line))]
    assert sorted(m.group(1) for m in decisions) == [f"r{i:03d}" for i in range(1, 81)]
    assert {m.group(5) for m in decisions} == {"200"}
    # lora-prefix scores every pod; the pfx column shows the chosen pod's prefix match.
    lines = [line for line in main.splitlines() if DECISION.match(line)]
    assert all("best score" in line for line in lines)
    matches = [float(m.group(1)) for line in lines if (m := PREFIX.search(line))]
    assert len(matches) == 80
    assert all(0 <= match <= 1 for match in matches)
    assert sum(match > 0.8 for match in matches) >= 10  # a group's prompt seen on that pod
    assert "summary: 80 requests" in out
    assert "answers   200 x80" in out
    routed = re.search(r"per pod\s+(.*)", out)
    assert routed is not None
    per_pod = dict(re.findall(r"(vllm-\d) (\d+)", routed.group(1)))
    assert sorted(per_pod) == [f"vllm-{i}" for i in range(6)]
    assert sum(int(n) for n in per_pod.values()) == 80
    rows = figures(out)
    assert rows["completed"] == ["80", "80", "same"]
    ours, random = (float(cell.rstrip("%")) for cell in rows["prefix-cache hit rate"][:2])
    assert ours > random + 10  # the same prompts, kept where their blocks are
    ours, random = (float(cell) for cell in rows["pods per adapter"][:2])
    assert ours < random
    assert len(rows["TTFT p90 (streams)"]) >= 4  # both runs streamed some
    ports = ADMIN.search(out)
    assert ports is not None
    assert all(refuses_connections(int(port)) for port in ports.groups())


def test_precise_prefix_matching_on_shared_prefixes_shows_the_match_without_a_baseline() -> None:
    process = demo(
        "--workload", "shared-prefix", "--prefix-index", "precise", "--no-baseline",
        "--requests", "30", "--rate", "20", "--time-scale", "10",
    )  # fmt: skip
    out, err = process.communicate(timeout=90)
    assert process.returncode == 0, err
    assert "prefix matching precise" in out
    lines = [line for line in out.splitlines() if DECISION.match(line)]
    assert len(lines) == 30
    assert {line.split()[1].rstrip("~") for line in lines} == {"Llama-2-7b-hf"}
    # The pods' KV events tell policyd where each group's prompt is cached.
    matches = [float(m.group(1)) for line in lines if (m := PREFIX.search(line))]
    assert sum(match > 0.8 for match in matches) >= 10
    assert "replaying" not in out and "random" not in out
    assert figures_alone(out)["prefix-cache hit rate"][0].endswith("%")


def figures_alone(out: str) -> dict[str, list[str]]:
    table = out[out.index("  completed") :].splitlines()[:6]
    return {line[:26].strip(): line[26:].split() for line in table}


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
    assert "replaying" not in out  # --continuous has no baseline
    assert figures_alone(out)["completed"][0].isdigit()  # the figures of what did run
    ports = ADMIN.search("".join(lines))
    assert ports is not None
    assert all(refuses_connections(int(port)) for port in ports.groups())
