"""The standard gRPC health service, with the endpoint-picker protocol's names.

- ``""`` and ``liveness``: SERVING while the process answers gRPC at all.
- ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor``: SERVING
  only while the readiness callable says policyd can route (pods and their
  metrics loaded). It is polled, so a callable that turns false again (every
  pod stale) turns readiness off again.
- On shutdown every service turns NOT_SERVING first, so load balancers stop
  sending new streams while open ones drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from grpc_health.v1 import health, health_pb2

from policyd.extproc.interfaces import Readiness

log = logging.getLogger("policyd.extproc.health")

LIVENESS: Final = "liveness"
READINESS: Final = "readiness"
EXT_PROC_SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"

SERVING: Final = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: Final = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthReporter:
    """Owns the health servicer and keeps readiness in step with ``ready``."""

    def __init__(self, ready: Readiness, poll_seconds: float = 0.5) -> None:
        self.servicer = health.aio.HealthServicer()
        self._ready = ready
        self._poll_seconds = poll_seconds
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.servicer.set("", SERVING)
        await self.servicer.set(LIVENESS, SERVING)
        ready = self._check()
        await self._publish(ready)
        self._task = asyncio.create_task(self._poll(ready), name="policyd-readiness")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.servicer.enter_graceful_shutdown()

    def _check(self) -> bool:
        try:
            return bool(self._ready())
        except Exception:
            log.exception("the readiness check raised; reporting not ready")
            return False

    async def _publish(self, ready: bool) -> None:
        status = SERVING if ready else NOT_SERVING
        await self.servicer.set(READINESS, status)
        await self.servicer.set(EXT_PROC_SERVICE, status)

    async def _poll(self, last: bool) -> None:
        while True:
            await asyncio.sleep(self._poll_seconds)
            ready = self._check()
            if ready != last:
                log.info("readiness: %s", "ready" if ready else "not ready")
                await self._publish(ready)
                last = ready
