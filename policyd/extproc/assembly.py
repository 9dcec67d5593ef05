"""policyd in one process: the policy store, the pod pool and the ext_proc server.

``policyd serve`` runs one of these per worker; the demo, the end-to-end
tests and the overhead benchmark build the same object in their own process,
so what they exercise is exactly what ships::

    service = Policyd(PolicyStore.open(Path("rules/default.yaml")), pool,
                      ServerOptions(host="0.0.0.0", port=9002))
    await service.start()          # pods loaded, policy watched, gRPC listening
    ...
    await service.stop()           # drain open streams, then stop watching and scraping

Readiness (the gRPC ``readiness`` health service) is the pool's: pods known
and each scraped once. Requests arriving before that are routed over the
candidates known so far, so they get a 503 rather than wait. The policy file
is polled for changes; a version that loads replaces the old one from the
next request on, one that does not is logged with its ``file:line:col``
reasons and the old one keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.extproc.interfaces import Telemetry
from policyd.extproc.prefix_matching import PrefixMatching
from policyd.latency.learning import Learning
from policyd.latency.models import LatencyModels
from policyd.policy import PolicyStore, Reload, Router
from policyd.pool import Pool
from policyd.prefix.options import PrefixSettings
from policyd.telemetry.fanout import combine

log = logging.getLogger("policyd.extproc.service")

ReloadListener = Callable[[Reload], None]


def _predictions_read(store: PolicyStore) -> Callable[[], bool]:
    """Whether a policy in force (or one of its shadows) reads the predicted latencies:
    the models learn only then. Kept per policy set, which a reload replaces whole."""
    seen: list[object] = [None, False]

    def wanted() -> bool:
        current = store.current
        if seen[0] is not current:
            every = (*current.policies, *(s for p in current.policies for s in p.shadows))
            seen[:] = [current, any(p.reads_prediction for p in every)]
        return bool(seen[1])

    return wanted


class Policyd:
    """One policyd: owns the router over ``store``, the ``pool`` and the gRPC server."""

    def __init__(
        self,
        store: PolicyStore,
        pool: Pool,
        options: ServerOptions,
        *,
        telemetry: Telemetry | None = None,
        policy_poll_seconds: float = 1.0,
        on_reload: ReloadListener | None = None,
        prefix: PrefixSettings | None = None,
    ) -> None:
        if policy_poll_seconds <= 0:
            raise ValueError(f"policy poll interval must be positive, not {policy_poll_seconds}")
        self.store = store
        # The pods' latency models learn from every routed exchange and cost a decision
        # nothing until a policy reads the predicted fields.
        self.latency = LatencyModels()
        self.router = Router(store, latency=self.latency)
        learning = Learning(self.latency, _predictions_read(store))
        telemetry = learning if telemetry is None else combine(telemetry, learning)
        self.pool = pool
        self.policy_poll_seconds = policy_poll_seconds
        self._on_reload = on_reload
        router = self.router
        # Prefix matching costs nothing until a policy reads the prefix fields.
        self.prefix = PrefixMatching(prefix or PrefixSettings(), pool.snapshot)
        self.server = ExtProcServer(
            lambda: router,  # one Router for good: it reads store.current per decision
            pool.snapshot,
            telemetry=telemetry,
            ready=self.ready,
            options=options,
            prefix=self.prefix.locator,
            objects=pool.inference_objects,
        )
        self._watch: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        """The bound gRPC port (0 before ``start``)."""
        return self.server.port

    def ready(self) -> bool:
        return self.pool.snapshot().ready

    async def start(self) -> int:
        """Load the pods, watch the policy, start serving; returns the bound port.

        Raises ``DiscoveryError`` when the first pod set cannot be loaded and
        ``OSError`` when the port cannot be bound or a TLS file read; nothing
        is left running in either case.
        """
        try:
            await self.pool.start()
        except BaseException:  # including a cancelled start: stop what discovery began
            await self.pool.stop()
            raise
        try:
            self.prefix.start()
            self._watch = asyncio.create_task(
                self.store.watch(self.policy_poll_seconds, self._on_reload), name="policy-watch"
            )
            try:
                port = await self.server.start()
            except RuntimeError as error:  # how grpc reports an address it cannot bind
                raise OSError(str(error).partition(";")[0]) from None
        except BaseException:
            await self._stop_background()
            raise
        current = self.store.current
        log.info(
            "serving policy %s from %s over %d pods",
            current.version,
            self.store.path,
            len(self.pool.snapshot().pods),
        )
        return port

    async def stop(self, grace_seconds: float | None = None) -> None:
        """Drain (health NOT_SERVING, new streams refused, open ones finish), then stop."""
        try:
            await self.server.stop(grace_seconds)
        finally:
            await self._stop_background()

    async def _stop_background(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        await self.prefix.stop()
        await self.pool.stop()

    async def run_until_signalled(self) -> None:
        """Start, serve until SIGTERM or SIGINT, then drain and stop.

        A signal while starting (waiting for an API server that does not
        answer, say) abandons the start. A second signal during the drain is
        logged and otherwise ignored: the grace period bounds the drain.
        """
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()

        def on_signal(signum: signal.Signals) -> None:
            if stopping.is_set():
                log.info("%s again: still stopping", signum.name)
            else:
                log.info(
                    "%s: stopping; open streams get up to %gs to finish",
                    signum.name,
                    self.server.options.grace_seconds,
                )
            stopping.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            if not await self._start_unless(stopping):
                log.info("stopped before serving")
                return
            try:
                await stopping.wait()
            finally:
                await self.stop()
            log.info("stopped")
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)

    async def _start_unless(self, stopping: asyncio.Event) -> bool:
        """Start; False if ``stopping`` was set first (the start is then undone)."""
        starting = asyncio.ensure_future(self.start())
        stopped = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if starting.done():
            starting.result()  # raises what the start raised
            return True
        starting.cancel()  # start() stops whatever it had started
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return False
