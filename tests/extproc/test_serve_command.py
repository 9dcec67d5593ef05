"""``policyd serve`` refuses what cannot work, before serving anything, and says why.

Argument and policy problems are found before logging is set up, so they are
checked in process; problems found while starting (a bad pod file, a port in
use) run the command as its own process. The serving itself is proven end to
end in ``tests/e2e/test_serve_process.py``.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from policyd.cli import main

REPO = Path(__file__).resolve().parents[2]
POLICY = str(REPO / "rules" / "default.yaml")


@pytest.fixture
def pods(tmp_path: Path) -> str:
    path = tmp_path / "pods.yaml"
    path.write_text("pods:\n  - {name: a, address: '127.0.0.1:1'}\n")
    return str(path)


def serve(*arguments: str) -> int:
    return main(["serve", *arguments])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ([], "give exactly one of --pods FILE, --k8s-selector SELECTOR and --inference-pool NAME"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--port", "70000"], "--port must be from 0 to 65535"),
        (["--grace-seconds", "-1"], "--grace-seconds must not be negative"),
        (["--policy-poll-interval", "0"], "--policy-poll-interval must be positive"),
        (["--tls-cert", POLICY], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", POLICY], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--tls-cert", "/nonexistent.pem", "--tls-key", POLICY], "/nonexistent.pem: no such file"),
        (["--scrape-interval", "0.1", "--scrape-timeout", "0.5"], "timeout"),
        (["--metric-waiting", 'bad{"'], "label matchers must end with"),
        (["--monitoring-port", "65535", "--workers", "2"], "--monitoring-port must be from"),
        (["--monitoring-port", "9000", "--workers", "3", "--port", "9002"], "must not overlap"),
        (["--decision-log-sample-rate", "1.5"], "--decision-log-sample-rate must be from 0 to 1"),
        (["--prefix-tokenizer", "gpt"], "unknown prefix tokenizer 'gpt'"),
        (["--prefix-tokenizer", "hf:/nonexistent.json"], "cannot load the tokenizer file"),
        (["--prefix-block-size", "0"], "--prefix-block-size must be positive"),
        (["--kv-events-port", "0"], "--kv-events-port must be from 1 to 65535"),
    ],
)
def test_flags_that_cannot_work_are_a_usage_error(
    pods: str, arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with_pods = [] if not arguments else ["--pods", pods]
    assert serve("--policy", POLICY, *with_pods, *arguments) == 2
    error = capsys.readouterr().err
    assert error.startswith("policyd serve: ")
    assert message in error


def test_both_pod_sources_at_once_are_a_usage_error(
    pods: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve("--policy", POLICY, "--pods", pods, "--k8s-selector", "app=vllm") == 2
    assert "give exactly one of" in capsys.readouterr().err


def test_a_missing_policy_is_a_usage_error(pods: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert serve("--policy", "/nonexistent/policy.yaml", "--pods", pods) == 2
    assert "--policy /nonexistent/policy.yaml: no such file or directory" in capsys.readouterr().err


def test_a_policy_that_does_not_load_stops_the_start_with_every_place(
    tmp_path: Path, pods: str, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text(
        "name: bad\nfilters:\n  a:\n    keep: pod.waiting_qeue < 3\n    next: b\n"
        "  b:\n    keep: pod.kv_cache < 1\n"
    )
    assert serve("--policy", str(policy), "--pods", pods) == 1
    error = capsys.readouterr().err
    assert "policyd serve: the policy does not load:" in error
    assert f"{policy}:4:14: undefined field 'waiting_qeue'" in error
    assert f"{policy}:7:" in error  # double < int: every problem, not just the first


def test_an_unknown_flag_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        serve("--policy", POLICY, "--pods", "x", "--scrape-intervall", "1")
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --scrape-intervall" in capsys.readouterr().err


def run_serve(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "policyd",
            "serve",
            "--policy",
            POLICY,
            "--monitoring-port",
            "0",
            *arguments,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_bad_pod_file_stops_the_start_with_its_line(tmp_path: Path) -> None:
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods:\n  - {name: a, address: oops}\n")
    result = run_serve("--pods", str(pods), "--port", "0")
    assert result.returncode == 1
    assert f"cannot load the pods: {pods}:2:" in result.stderr
    assert "'oops' is not ip:port" in result.stderr


def test_a_port_in_use_stops_the_start(pods: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_serve("--pods", pods, "--port", str(port), "--log-format", "json")
    assert result.returncode == 1
    # policyd's own lines are JSON events (gRPC's C core prints its own line too)
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert events[-1]["level"] == "error"
    assert events[-1]["message"].startswith(
        f"cannot serve on 127.0.0.1 port {port}: Failed to bind"
    )


def test_sigterm_while_waiting_for_an_unreachable_api_server_stops_at_once(
    tmp_path: Path,
) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u, namespace: default}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "policyd", "serve", "--policy", POLICY, "--port", "0",
         "--monitoring-port", "0", "--k8s-selector", "app=vllm", "--kubeconfig", str(kubeconfig)],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert process.stderr is not None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            assert line, "policyd serve exited on its own"
            if "pod watch:" in line and "retrying in" in line:
                break  # the start is waiting for the API server
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    assert "stopped before serving" in rest
    assert "urllib3" not in rest  # the client's retries are not logged a second time
