"""The HTTP endpoint Prometheus scrapes: ``/metrics``, plus ``/healthz`` and ``/readyz``.

It runs an asyncio event loop on a thread of its own, not on the serving
loop: a scrape renders the whole registry, which must not hold up ext_proc
streams waiting for a decision.

- ``GET /metrics``: the registry in the Prometheus text format, or
  OpenMetrics when the scraper asks for it (``Accept``).
- ``GET /healthz``: 200 while the process serves HTTP at all (liveness).
- ``GET /readyz``: 200 when ``ready()`` is true, else 503 (readiness; the
  same question the gRPC health service's readiness check answers).

Idle or slow clients cannot pin resources: one thread serves every
connection; at most ``max_connections`` are open at once (one more is
accepted and closed at once); a request's head must arrive whole within
``read_timeout`` seconds of the connection or of the previous answer (a
keep-alive connection that stays idle that long is closed, and so is a
slow-loris one sending a byte at a time); a head over 16 KiB is a 431; an
answer the client does not read within ``write_timeout`` closes the
connection. Only GET and HEAD are served, without request bodies.

The server is policyd's own, not aiohttp's (a runtime dependency), because
aiohttp's offers none of those bounds and costs the same: in one run of
``benchmarks/metrics_http.py`` (benchmarks/RESULTS.md, "Monitoring
endpoint") both spend the same CPU per scrape and per probe (within 5%),
while aiohttp's holds every one of 200 slow-loris connections this server
closes at its read timeout; adding a head deadline and a connection cap to
aiohttp's server means reaching into its protocol class, more code than this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Final

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

MAX_HEAD_BYTES: Final = 16 * 1024
_TEXT: Final = "text/plain; charset=utf-8"
_REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class MetricsServer:
    """A running metrics endpoint; ``close()`` stops it."""

    def __init__(
        self,
        registry: CollectorRegistry,
        ready: Callable[[], bool],
        *,
        max_connections: int,
        read_timeout: float,
        write_timeout: float,
    ) -> None:
        self._registry = registry
        self._ready = ready
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.host = ""
        self.port = 0
        self.refused = 0  # connections closed at once: the cap was reached
        self.timed_out = 0  # connections closed for a head or an answer too slow
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._started = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread()  # replaced by start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._open)

    def start(self, host: str, port: int) -> None:
        """Bind (``OSError`` if it cannot) and serve on the thread."""
        self._thread = threading.Thread(
            target=self._run, args=(host, port), name="policyd-metrics", daemon=True
        )
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _run(self, host: str, port: int) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            try:
                server = loop.run_until_complete(
                    asyncio.start_server(
                        self._connection, host, port, backlog=128, limit=MAX_HEAD_BYTES
                    )
                )
            except Exception as error:
                self._error = error
                return
            self._server = server
            address = server.sockets[0].getsockname()
            self.host, self.port = address[0], address[1]
            self._started.set()
            loop.run_forever()
            server.close()
            for writer in list(self._open):
                writer.transport.abort()
            loop.run_until_complete(asyncio.sleep(0))  # let the aborts run
        finally:
            self._started.set()
            with contextlib.suppress(Exception):
                for task in asyncio.all_tasks(loop):
                    task.cancel()
                loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= self.max_connections:
            self.refused += 1
            writer.transport.abort()
            return
        self._open.add(writer)
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, OSError):
            pass
        except Exception:
            log.exception("the metrics endpoint failed on a connection")
        finally:
            self._open.discard(writer)
            writer.transport.abort()  # nothing left to flush: every answer was drained

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Read one request and answer it; whether the connection stays open."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout)
        except TimeoutError:
            self.timed_out += 1
            return False
        except asyncio.IncompleteReadError:
            return False  # the client closed
        except asyncio.LimitOverrunError:
            await self._answer(writer, 431, b"request head too large\n", keep_alive=False)
            return False
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            await self._answer(writer, 400, b"bad request\n", keep_alive=False)
            return False
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if colon:
                headers[name.strip().lower()] = value.strip()
        connection = headers.get("connection", "").lower()
        keep_alive = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
        if method not in ("GET", "HEAD"):
            await self._answer(writer, 405, b"only GET and HEAD\n", keep_alive=False)
            return False
        if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
            await self._answer(writer, 400, b"no request body expected\n", keep_alive=False)
            return False
        status, body, content_type = self._route(target.split("?", 1)[0], headers)
        return await self._answer(
            writer, status, body, content_type, keep_alive=keep_alive, head_only=method == "HEAD"
        )

    def _route(self, path: str, headers: dict[str, str]) -> tuple[int, bytes, str]:
        if path == "/metrics":
            encoder, content_type = choose_encoder(headers.get("accept", ""))
            try:
                return 200, encoder(self._registry), content_type
            except Exception:
                log.exception("rendering the metrics failed")
                return 500, b"cannot render the metrics\n", _TEXT
        if path == "/healthz":
            return 200, b"ok\n", _TEXT
        if path == "/readyz":
            is_ready = _safely(self._ready)
            return (200, b"ready\n", _TEXT) if is_ready else (503, b"not ready\n", _TEXT)
        return 404, b"not found: try /metrics, /healthz or /readyz\n", _TEXT

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        content_type: str = _TEXT,
        *,
        keep_alive: bool,
        head_only: bool = False,
    ) -> bool:
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
            f"Server: policyd\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
        ).encode("latin-1")
        writer.write(head if head_only else head + body)
        try:
            await asyncio.wait_for(writer.drain(), self.write_timeout)
        except TimeoutError:
            self.timed_out += 1
            return False
        return keep_alive


def start_metrics_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    *,
    ready: Callable[[], bool] = lambda: True,
    max_connections: int = 64,
    read_timeout: float = 10.0,
    write_timeout: float = 10.0,
) -> MetricsServer:
    """Serve ``registry`` on ``host:port`` (0: any free port) until ``close()``."""
    server = MetricsServer(
        registry,
        ready,
        max_connections=max_connections,
        read_timeout=read_timeout,
        write_timeout=write_timeout,
    )
    server.start(host, port)
    return server


def _safely(ready: Callable[[], bool]) -> bool:
    try:
        return bool(ready())
    except Exception:
        log.exception("the readiness check raised")
        return False
