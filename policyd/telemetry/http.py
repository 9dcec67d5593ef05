"""The HTTP endpoint Prometheus scrapes: ``/metrics``, plus ``/healthz`` and ``/readyz``.

It runs on a thread of its own (``http.server``), not on the event loop: a
scrape renders the whole registry, which must not hold up ext_proc streams
waiting for a decision.

- ``GET /metrics``: the registry in the Prometheus text format, or
  OpenMetrics when the scraper asks for it (``Accept``).
- ``GET /healthz``: 200 while the process serves HTTP at all (liveness).
- ``GET /readyz``: 200 when ``ready()`` is true, else 503 (readiness; the
  same question the gRPC health service's readiness check answers).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)


class MetricsServer:
    """A running metrics endpoint; ``close()`` stops it."""

    def __init__(self, server: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host: str = server.server_address[0]  # type: ignore[assignment]
        self.port: int = server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    *,
    ready: Callable[[], bool] = lambda: True,
) -> MetricsServer:
    """Serve ``registry`` on ``host:port`` (0: any free port) until ``close()``."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "policyd"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                try:
                    body = encoder(registry)
                except Exception:
                    log.exception("rendering the metrics failed")
                    self._answer(500, b"cannot render the metrics\n")
                    return
                self._answer(200, body, content_type)
            elif path == "/healthz":
                self._answer(200, b"ok\n")
            elif path == "/readyz":
                is_ready = _safely(ready)
                self._answer(200 if is_ready else 503, b"ready\n" if is_ready else b"not ready\n")
            else:
                self._answer(404, b"not found: try /metrics, /healthz or /readyz\n")

        def _answer(
            self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8"
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return  # scrapes every few seconds are not news

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(
        target=server.serve_forever, name="policyd-metrics", kwargs={"poll_interval": 0.2}
    )
    thread.daemon = True
    thread.start()
    return MetricsServer(server, thread)


def _safely(ready: Callable[[], bool]) -> bool:
    try:
        return bool(ready())
    except Exception:
        log.exception("the readiness check raised")
        return False
