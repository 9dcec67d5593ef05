"""The policyd gRPC server: ext_proc + health, TLS, graceful shutdown.

Build one from a policy store and a pool (``assembly.Policyd`` does this) and
run it::

    router = Router(store)                      # reads store.current per decision (hot swap)
    server = ExtProcServer(
        routers=lambda: router,                 # called per request
        snapshots=pool.snapshot,                # called per request (immutable snapshots)
        telemetry=telemetry,                    # optional
        ready=lambda: pool.snapshot().ready,    # drives the readiness check
        options=ServerOptions(port=9002),
    )
    await server.run_until_signalled()          # SIGTERM/SIGINT: drain, then return

Shutdown marks every health service NOT_SERVING, stops accepting new streams
and gives the open ones (requests still generating) up to
``grace_seconds`` to finish before cancelling them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2_grpc

from policyd.extproc.health import HealthReporter
from policyd.extproc.interfaces import (
    NoTelemetry,
    Readiness,
    RouterSource,
    SnapshotSource,
    Telemetry,
)
from policyd.extproc.objectives import ObjectsSource, no_objects
from policyd.extproc.process_stream import ExternalProcessor
from policyd.extproc.serving import ServingSettings
from policyd.prefix.probe import PrefixLocator

log = logging.getLogger("policyd.extproc.server")

GRPC_OVERHEAD_BYTES = 1024 * 1024  # headers and framing around the largest body


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for TLS; with ``client_ca`` set, clients (Envoy) must present a cert."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        client_ca = self.client_ca.read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )


@dataclass(frozen=True, slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 9002  # 0: any free port (tests)
    tls: TlsFiles | None = None
    grace_seconds: float = 30.0
    # Several worker processes bind the same port; the kernel spreads connections.
    reuse_port: bool = False
    readiness_poll_seconds: float = 0.5
    settings: ServingSettings = field(default_factory=ServingSettings)


class ExtProcServer:
    def __init__(
        self,
        routers: RouterSource,
        snapshots: SnapshotSource,
        *,
        telemetry: Telemetry | None = None,
        ready: Readiness = lambda: True,
        options: ServerOptions | None = None,
        prefix: PrefixLocator | None = None,
        objects: ObjectsSource = no_objects,
    ) -> None:
        self.options = options or ServerOptions()
        self.processor = ExternalProcessor(
            routers,
            snapshots,
            telemetry or NoTelemetry(),
            self.options.settings,
            prefix,
            objects=objects,
        )
        self.health = HealthReporter(ready, self.options.readiness_poll_seconds)
        self.port = 0
        self._server: grpc.aio.Server | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port."""
        options = self.options
        message_limit = options.settings.max_body_bytes + GRPC_OVERHEAD_BYTES
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 1 if options.reuse_port else 0),
                ("grpc.max_receive_message_length", message_limit),
                ("grpc.max_send_message_length", message_limit),
            ]
        )
        server.add_generic_rpc_handlers((_process_handler(self.processor),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        address = f"{options.host}:{options.port}"
        if options.tls is None:
            self.port = server.add_insecure_port(address)
        else:
            self.port = server.add_secure_port(address, options.tls.credentials())
        await server.start()
        await self.health.start()
        self._server = server
        log.info(
            "policyd ext_proc listening on %s:%d (%s)",
            options.host,
            self.port,
            "mTLS" if options.tls and options.tls.client_ca else "TLS" if options.tls else "plain",
        )
        return self.port

    async def stop(self, grace_seconds: float | None = None) -> None:
        """Turn health NOT_SERVING, dispatch or answer the held requests, refuse new
        streams, let open ones finish."""
        server = self._server
        if server is None:
            return
        self._server = None
        await self.health.shutdown()
        grace = self.options.grace_seconds if grace_seconds is None else grace_seconds
        # Held requests get half the grace to be dispatched as pods free up (then
        # 503), the rest of it to be served like any open stream.
        started = time.monotonic()
        holding = self.processor.holding
        await holding.drain(grace / 2)
        holding.stop()
        await server.stop(max(0.0, grace - (time.monotonic() - started)))
        self.processor.settlement.flush()  # the last requests' spans and metrics

    async def run_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT, then shut down gracefully."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        try:
            await self.start()
            await stop.wait()
            log.info("stopping: draining open streams for up to %.0fs", self.options.grace_seconds)
        finally:
            await self.stop()  # a second signal during the drain changes nothing
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)


def _process_handler(processor: ExternalProcessor) -> grpc.GenericRpcHandler:
    """``ExternalProcessor/Process``, its replies sent as the wire bytes they are."""
    process = grpc.stream_stream_rpc_method_handler(
        processor.Process,
        request_deserializer=pb.ProcessingRequest.FromString,
        response_serializer=None,
    )
    return grpc.method_handlers_generic_handler(_SERVICE, {"Process": process})


_SERVICE: Final = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
