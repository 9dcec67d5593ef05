"""The real Jaeger v2 binary, run with the configuration ``telemetry/jaeger.yaml`` ships.

The configuration is taken from that file's ConfigMap as it is; only its
listen addresses change, from ``0.0.0.0`` and the standard ports (what a pod
needs) to loopback and free ports, so it can run on a shared machine.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from e2e_support import free_port

ASSETS = Path(__file__).resolve().parents[2] / "telemetry"
ANY_HOST = "0.0.0.0"


def shipped_config() -> dict[str, Any]:
    """Jaeger's configuration, from the ConfigMap in ``telemetry/jaeger.yaml``."""
    docs = [d for d in yaml.safe_load_all((ASSETS / "jaeger.yaml").read_text()) if d]
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    (text,) = config_map["data"].values()
    config: dict[str, Any] = yaml.safe_load(text)
    return config


def on_loopback(node: Any, ports: dict[int, int]) -> Any:
    """``node`` with every ``0.0.0.0:PORT`` endpoint (and ``host``/``port`` pair)
    moved to ``127.0.0.1`` and a free port; ``ports`` maps the shipped ports to those."""

    def moved(port: int) -> int:
        if port not in ports:
            ports[port] = free_port()
        return ports[port]

    if isinstance(node, dict):
        if node.get("host") == ANY_HOST and isinstance(node.get("port"), int):
            node = {**node, "host": "127.0.0.1", "port": moved(node["port"])}
        return {key: on_loopback(value, ports) for key, value in node.items()}
    if isinstance(node, list):
        return [on_loopback(value, ports) for value in node]
    if isinstance(node, str) and node.startswith(f"{ANY_HOST}:"):
        return f"127.0.0.1:{moved(int(node.rsplit(':', 1)[1]))}"
    return node


def get_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    """GET ``url``: the status and the decoded JSON body (None when it is not JSON)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


@dataclass
class Jaeger:
    process: subprocess.Popen[bytes]
    ports: dict[int, int]  # shipped port -> the port it runs on here
    log: Path

    @property
    def otlp_grpc(self) -> str:
        return f"127.0.0.1:{self.ports[4317]}"

    @property
    def query(self) -> str:
        return f"http://127.0.0.1:{self.ports[16686]}"

    @property
    def health(self) -> str:
        return f"http://127.0.0.1:{self.ports[13133]}/status"

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def traces(self, service: str, since_ns: int, until_ns: int) -> tuple[int, Any]:
        """``/api/v3/traces`` of ``service`` started in the window."""
        query = urllib.parse.urlencode(
            {
                "query.service_name": service,
                "query.start_time_min": rfc3339(since_ns),
                "query.start_time_max": rfc3339(until_ns),
                "query.num_traces": "20",
            }
        )
        return get_json(f"{self.query}/api/v3/traces?{query}")

    def trace(self, trace_id: str) -> tuple[int, Any]:
        """``/api/v3/traces/TRACE_ID``."""
        return get_json(f"{self.query}/api/v3/traces/{trace_id}")


def rfc3339(ns: int) -> str:
    seconds, fraction = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{fraction:09d}Z"


def start_jaeger(binary: str, directory: Path) -> Jaeger:
    """Run ``binary --config`` with the shipped configuration until it reports healthy."""
    ports: dict[int, int] = {}
    config = on_loopback(shipped_config(), ports)
    config_file = directory / "jaeger-config.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    log = directory / "jaeger.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [binary, f"--config={config_file}"], stdout=output, stderr=subprocess.STDOUT
        )
    jaeger = Jaeger(process, ports, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"jaeger exited with {process.returncode}:\n{jaeger.log_tail()}")
        try:
            if get_json(jaeger.health, timeout=1.0)[0] == 200:
                return jaeger
        except OSError:
            pass
        time.sleep(0.2)
    stop_jaeger(jaeger)
    raise AssertionError(f"jaeger did not report healthy within 60 s:\n{jaeger.log_tail()}")


def stop_jaeger(jaeger: Jaeger) -> None:
    jaeger.process.terminate()
    try:
        jaeger.process.wait(10)
    except subprocess.TimeoutExpired:
        jaeger.process.kill()
        jaeger.process.wait()
