"""The gRPC server around the servicer: health, TLS, draining, signals, workers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from extproc_support import (
    EnvoySide,
    PickFirst,
    RecordingTelemetry,
    request_body,
    request_headers,
    response_headers,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from policyd.extproc.grpc_server import ExtProcServer, ServerOptions, TlsFiles
from policyd.extproc.health import EXT_PROC_SERVICE, LIVENESS, READINESS
from policyd.pool.pod import Pod

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BODY = {"model": "m", "prompt": "p"}
SCRIPT = Path(__file__).with_name("scripted_policyd.py")


@dataclass(frozen=True)
class Snapshot:
    candidates: tuple[Pod, ...]


def make_server(**options: object) -> tuple[ExtProcServer, RecordingTelemetry, Pod]:
    """A server over one pod with a pick-first router."""
    telemetry = RecordingTelemetry()
    router = PickFirst()
    pods = Snapshot((Pod("pod-a", "10.0.0.1:8000"),))
    ready = options.pop("ready", lambda: True)
    server = ExtProcServer(
        lambda: router,
        lambda: pods,
        telemetry=telemetry,
        ready=ready,  # type: ignore[arg-type]
        options=ServerOptions(port=0, **options),  # type: ignore[arg-type]
    )
    return server, telemetry, pods.candidates[0]


async def status_of(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(reply.status)


async def settles_to(channel: grpc.aio.Channel, service: str, status: int) -> bool:
    """Whether ``service`` reaches ``status`` within 30 s (readiness is polled)."""
    for _ in range(1500):
        if await status_of(channel, service) == status:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_liveness_serves_at_once_and_readiness_follows_the_callable() -> None:
    ready = [False]
    server, _, _ = make_server(ready=lambda: ready[0], readiness_poll_seconds=0.02)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert await status_of(channel, "") == SERVING
        assert await status_of(channel, LIVENESS) == SERVING
        assert await status_of(channel, READINESS) == NOT_SERVING
        assert await status_of(channel, EXT_PROC_SERVICE) == NOT_SERVING
        ready[0] = True
        assert await settles_to(channel, READINESS, SERVING)
        assert await status_of(channel, EXT_PROC_SERVICE) == SERVING
        ready[0] = False  # e.g. every pod's metrics went stale
        assert await settles_to(channel, READINESS, NOT_SERVING)
    finally:
        await channel.close()
        await server.stop(0)


async def test_a_readiness_check_that_raises_reads_as_not_ready() -> None:
    def broken() -> bool:
        raise RuntimeError("datastore bug")

    server, _, _ = make_server(ready=broken)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert await status_of(channel, READINESS) == NOT_SERVING
        assert await status_of(channel, LIVENESS) == SERVING
    finally:
        await channel.close()
        await server.stop(0)


async def test_a_port_in_use_is_an_error_unless_workers_share_it() -> None:
    first, _, _ = make_server()
    port = await first.start()
    second, _, _ = make_server()
    second.options = dataclasses.replace(second.options, port=port)
    try:
        with pytest.raises(RuntimeError, match="Failed to bind"):
            await second.start()
    finally:
        await first.stop(0)


async def test_tls_serves_clients_that_trust_the_ca(certificates: Any) -> None:
    tls = TlsFiles(certificates.server_cert, certificates.server_key)
    server, _, _ = make_server(tls=tls)
    port = await server.start()
    trusted = grpc.aio.secure_channel(
        f"127.0.0.1:{port}", grpc.ssl_channel_credentials(certificates.ca.read_bytes())
    )
    plain = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert await status_of(trusted, LIVENESS) == SERVING
        with pytest.raises(grpc.aio.AioRpcError):
            await status_of(plain, LIVENESS)
    finally:
        await trusted.close()
        await plain.close()
        await server.stop(0)


async def test_mutual_tls_refuses_clients_without_a_certificate(
    certificates: Any,
) -> None:
    tls = TlsFiles(certificates.server_cert, certificates.server_key, certificates.ca)
    server, _, _ = make_server(tls=tls)
    port = await server.start()
    ca = certificates.ca.read_bytes()
    anonymous = grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca))
    identified = grpc.aio.secure_channel(
        f"127.0.0.1:{port}",
        grpc.ssl_channel_credentials(
            ca, certificates.client_key.read_bytes(), certificates.client_cert.read_bytes()
        ),
    )
    try:
        assert await status_of(identified, LIVENESS) == SERVING
        with pytest.raises(grpc.aio.AioRpcError):
            await status_of(anonymous, LIVENESS)
    finally:
        await anonymous.close()
        await identified.close()
        await server.stop(0)


async def test_stopping_refuses_new_streams_and_lets_open_ones_finish() -> None:
    server, telemetry, _ = make_server(grace_seconds=600.0)  # longer than the test may take
    port = await server.start()
    envoy = EnvoySide(port)
    call = envoy.open()
    for message in (request_headers(), request_body(BODY)):
        await call.write(message)
        await call.read()
    stopping = asyncio.create_task(server.stop())
    await asyncio.sleep(0.2)
    assert not stopping.done()  # waiting for the open stream
    with pytest.raises(grpc.aio.AioRpcError):
        await EnvoySide(port).exchange(request_headers())
    await call.write(response_headers(end_of_stream=True))
    assert await call.read() is grpc.aio.EOF  # the response's end: answered by status OK
    assert await call.code() == grpc.StatusCode.OK
    await call.done_writing()
    await asyncio.wait_for(stopping, 30)  # ended by the stream, not by the grace period
    assert telemetry.spans[0].ends[0]["completed"] is True
    await envoy.close()


async def test_streams_still_open_after_the_grace_period_are_cut_and_settled() -> None:
    server, telemetry, pod = make_server(grace_seconds=0.3)
    port = await server.start()
    envoy = EnvoySide(port)
    call = envoy.open()
    for message in (request_headers(), request_body(BODY)):
        await call.write(message)
        await call.read()
    assert pod.in_flight == 1
    await asyncio.wait_for(server.stop(), 30)
    for _ in range(3000):
        if telemetry.spans[0].ends:
            break
        await asyncio.sleep(0.01)
    assert telemetry.spans[0].ends[0]["completed"] is False
    assert pod.in_flight == 0
    await envoy.close()


# -- separate processes: signals and workers ------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_policyd(port: int, workers: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--port", str(port), "--workers", str(workers)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def wait_serving(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60  # generous: workers start slowly on a loaded machine
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        while time.monotonic() < deadline:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            try:
                if await status_of(channel, READINESS) == SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError("policyd did not become ready")


def wait_exit(process: subprocess.Popen[bytes], timeout: float = 60) -> int:
    try:
        return process.wait(timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def worker_pid_of_one_stream(port: int) -> int:
    envoy = EnvoySide(port)  # a new channel, hence a new connection
    try:
        _, reply = await envoy.exchange(request_headers(), request_body(BODY))
    finally:
        await envoy.close()
    header = reply.request_body.response.header_mutation.set_headers[0].header
    return int(header.raw_value.decode().rpartition(":")[2])


async def worker_pids(port: int, expected: int) -> set[int]:
    """Open fresh connections until ``expected`` workers have answered (bounded).

    A worker that is still starting has not bound the port yet, so the first
    connections may all land on the one that is up.
    """
    pids: set[int] = set()
    deadline = time.monotonic() + 60
    for _ in range(1200):
        pids.add(await worker_pid_of_one_stream(port))
        if len(pids) >= expected or time.monotonic() > deadline:
            break
    return pids


async def test_sigterm_drains_an_open_stream_then_exits_cleanly() -> None:
    port = free_port()
    process = start_policyd(port, workers=1)
    try:
        await wait_serving(port, process)
        envoy = EnvoySide(port)
        call = envoy.open()
        for message in (request_headers(), request_body(BODY)):
            await call.write(message)
            await call.read()
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert process.poll() is None  # still draining
        await call.write(response_headers(end_of_stream=True))
        assert await call.read() is grpc.aio.EOF  # the response's end: answered by status OK
        assert await call.code() == grpc.StatusCode.OK
        await call.done_writing()
        await envoy.close()
        assert await asyncio.to_thread(wait_exit, process) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_workers_share_the_port_and_stop_together_on_sigterm() -> None:
    port = free_port()
    process = start_policyd(port, workers=2)
    try:
        await wait_serving(port, process)
        pids = await worker_pids(port, expected=2)
        assert len(pids) == 2  # both workers took connections
        assert process.pid not in pids
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(wait_exit, process) == 0
        assert not any(alive(pid) for pid in pids)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever adopted it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
async def test_workers_stop_when_their_parent_is_killed() -> None:
    port = free_port()
    process = start_policyd(port, workers=2)
    pids: set[int] = set()
    try:
        await wait_serving(port, process)
        pids = await worker_pids(port, expected=2)
        assert len(pids) == 2 and all(running(pid) for pid in pids)
        process.kill()  # SIGKILL: the parent passes nothing on
        process.wait()
        deadline = time.monotonic() + 60
        while any(running(pid) for pid in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not any(running(pid) for pid in pids)
    finally:
        for pid in pids:  # whatever survived a failure
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_when_one_worker_dies_the_others_stop_and_the_exit_says_so() -> None:
    port = free_port()
    process = start_policyd(port, workers=2)
    try:
        await wait_serving(port, process)
        victim, survivor = sorted(await worker_pids(port, expected=2))
        os.kill(victim, signal.SIGKILL)
        assert await asyncio.to_thread(wait_exit, process) == 128 + signal.SIGKILL
        assert not alive(survivor)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
