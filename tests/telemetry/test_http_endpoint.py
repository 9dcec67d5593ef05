"""The monitoring endpoint: idle and slow clients cannot pin threads or descriptors.

One thread serves every connection; connections over the cap are closed at
once; a request head that does not arrive whole in time (an idle keep-alive
connection, a slow-loris client sending a byte at a time) closes its
connection; ``/metrics`` and the health paths answer throughout.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from policyd.telemetry.http import MetricsServer, start_metrics_server


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    registry = CollectorRegistry()
    Counter("policyd_test", "A counter.", registry=registry).inc()
    server = start_metrics_server(
        "127.0.0.1", 0, registry, max_connections=32, read_timeout=0.5, write_timeout=0.5
    )
    yield server
    server.close()


def fetch(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, response.read()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def closed_by_peer(sock: socket.socket, wait: float) -> bool:
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_it_serves_metrics_health_head_and_keep_alive(server: MetricsServer) -> None:
    status, body = fetch(server.url + "/metrics")
    assert status == 200 and b"policyd_test_total 1.0" in body
    assert fetch(server.url + "/healthz") == (200, b"ok\n")
    with socket.create_connection((server.host, server.port)) as sock:
        for _ in range(3):  # one connection, three requests
            sock.sendall(b"HEAD /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            head = sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            assert head.endswith(b"\r\n\r\n")  # no body for HEAD
        sock.sendall(b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi")
        assert sock.recv(4096).startswith(b"HTTP/1.1 405")


def test_a_head_over_16_kib_is_a_431(server: MetricsServer) -> None:
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"y" * 20000 + b"\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 431")


def test_idle_connections_are_capped_closed_in_time_and_pin_no_thread(
    server: MetricsServer,
) -> None:
    threads, fds = threading.active_count(), open_fds()
    idle = [socket.create_connection((server.host, server.port)) for _ in range(100)]
    try:
        time.sleep(0.1)
        assert server.connections <= 32
        assert server.refused >= 100 - 32  # over the cap: closed at once
        assert threading.active_count() == threads  # no thread per connection
        # Metrics still answer, once the cap has room (the refused ones are gone).
        deadline = time.monotonic() + 3
        while True:
            try:
                assert fetch(server.url + "/metrics")[0] == 200
                break
            except OSError:  # refused at the cap: retry as Prometheus would
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert all(closed_by_peer(sock, 2.0) for sock in idle)  # read timeout 0.5 s
        for _ in range(3000):
            if server.connections == 0:
                break
            time.sleep(0.01)
        assert server.connections == 0
        assert server.timed_out >= 1
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.1)
    assert open_fds() <= fds + 1


def test_a_slow_loris_is_closed_at_the_read_timeout(server: MetricsServer) -> None:
    with socket.create_connection((server.host, server.port)) as sock:
        closed = False
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" * 10:
            try:
                sock.send(bytes([byte]))
            except OSError:
                closed = True
                break
            if closed_by_peer(sock, 0.05):
                closed = True
                break
            assert fetch(server.url + "/healthz")[0] == 200  # others are served meanwhile
    # A byte comes every 50 ms or more, so only a deadline for the whole head
    # (0.5 s), not one per read, closes the connection before the head is in.
    assert closed


def test_a_port_in_use_is_an_os_error(server: MetricsServer) -> None:
    with pytest.raises(OSError):
        start_metrics_server("127.0.0.1", server.port, CollectorRegistry())
