"""The pod pool the service runs: discovery, scraping and snapshots in one object.

The scrape rounds run in a child process (``ProcessScraper``) unless
``ScrapeConfig.in_process`` says to run them on this event loop (``Scraper``);
everything else (discovery, the datastore and its snapshots, in-flight
counters, staleness, statistics) lives here, on the serving loop.

```python
pool = Pool(StaticFileDiscovery(Path("pods.yaml")), ScrapeConfig(interval=0.1))
await pool.start()                 # first pod set loaded (a bad file raises here)
await pool.wait_ready(timeout=5)   # every pod scraped once
snapshot = pool.snapshot()         # immutable; read without locks, as often as needed
...
await pool.stop()
```

Telemetry reads ``stats`` (scrape counters, latency and last error per pod
address), ``rounds`` / ``overruns`` and each pod's ``metrics_age`` in the
snapshot, or registers ``add_listener`` for every scrape result as it lands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType

from policyd.fields.roles import ROLE_LABEL
from policyd.pool.datastore import Datastore, PoolSnapshot, ScrapeStats
from policyd.pool.discovery import Discovery, DiscoveryError, PodIdentity
from policyd.pool.inference_objects import NO_OBJECTS, InferenceObjects
from policyd.pool.scrape_process import ProcessScraper
from policyd.pool.scraper import ScrapeConfig, Scraper, ScrapeResult, ScrapeRounds, pod_presets

log = logging.getLogger(__name__)

ScrapeListener = Callable[[PodIdentity, ScrapeResult], None]


class Pool:
    """Keeps a live, scraped view of the pods a discovery source names."""

    def __init__(
        self,
        discovery: Discovery,
        config: ScrapeConfig | None = None,
        *,
        role_label: str = ROLE_LABEL,
    ) -> None:
        """``role_label``: the pod label that gives ``pod.role`` (``policyd.fields.roles``)."""
        self.config = config or ScrapeConfig()
        self._discovery = discovery
        # The InferencePool's objectives and rewrites, from a source that follows
        # them (``KubernetesDiscovery`` with an InferencePool); none from the others.
        self.inference_objects: Callable[[], InferenceObjects] = getattr(
            discovery, "inference_objects", lambda: NO_OBJECTS
        )
        self._ready = asyncio.Event()
        self._datastore = Datastore(
            stale_after=self.config.stale_threshold,
            include_stale=self.config.include_stale,
            panic=self.config.panic,
            on_publish=self._published,
            role_label=role_label,
        )
        self._scraper: ScrapeRounds | None = None
        self._updates: AsyncIterator[tuple[PodIdentity, ...]] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._listeners: list[ScrapeListener] = []
        self._presets: dict[str, str] = {}  # ``pod_presets``, made when the pod set changes
        self.rounds = 0
        self.overruns = 0  # rounds that ended after the next one was due
        self.panic_rounds = 0  # rounds after which the snapshot was in panic (Datastore)

    def snapshot(self) -> PoolSnapshot:
        """The current snapshot (one attribute read; never blocks)."""
        return self._datastore.snapshot

    @property
    def stats(self) -> Mapping[str, ScrapeStats]:
        """Scrape statistics per pod address."""
        return self._datastore.stats

    def add_listener(self, listener: ScrapeListener) -> None:
        """Call ``listener(pod, result)`` for every scrape result, on the event loop.

        Listeners run inside the scrape loop: they must be quick and must not raise.
        """
        self._listeners.append(listener)

    async def start(self) -> None:
        """Load the first pod set, then keep following discovery and scraping.

        Raises whatever the discovery source raises for its first set
        (``DiscoveryError`` for a bad pod file or missing permissions).
        """
        if self._tasks:
            raise RuntimeError("the pool is already started")
        self._updates = self._discovery.updates()
        try:
            first = await anext(self._updates)
        except StopAsyncIteration:
            raise DiscoveryError("the pod source ended before giving a pod set") from None
        self._scraper = (
            Scraper(self.config) if self.config.in_process else ProcessScraper(self.config)
        )
        self._set_pods(first)
        self._tasks = [
            asyncio.create_task(self._follow_discovery(self._updates), name="pool-discovery"),
            asyncio.create_task(self._scrape_forever(self._scraper), name="pool-scrape"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._updates is not None:
            aclose = getattr(self._updates, "aclose", None)
            if aclose is not None:
                await aclose()
            self._updates = None
        if self._scraper is not None:
            await self._scraper.close()
            self._scraper = None

    async def wait_ready(self, timeout: float) -> bool:
        """Whether the pool became ready (pods known, each scraped once) within ``timeout``."""
        try:
            async with asyncio.timeout(timeout):
                await self._ready.wait()
        except TimeoutError:
            return False
        return True

    async def __aenter__(self) -> Pool:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    def _published(self, snapshot: PoolSnapshot) -> None:
        if snapshot.ready:
            self._ready.set()
        else:
            self._ready.clear()

    async def _follow_discovery(self, updates: AsyncIterator[tuple[PodIdentity, ...]]) -> None:
        try:
            async for identities in updates:
                self._set_pods(identities)
                if self._scraper is not None:
                    self._scraper.retain(identity.address for identity in identities)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod discovery stopped; keeping the last pod set")

    def _set_pods(self, identities: tuple[PodIdentity, ...]) -> None:
        self._datastore.set_pods(identities)
        self._presets = pod_presets(
            self.config, ((identity.address, identity.labels) for identity in identities)
        )

    async def _scrape_forever(self, scraper: ScrapeRounds) -> None:
        loop = asyncio.get_running_loop()
        interval = self.config.interval
        due = loop.time()
        while True:
            addresses = self._datastore.addresses()
            if addresses:
                try:
                    self._land(await scraper.scrape(addresses, self._presets))
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("scrape round failed")
            due += interval
            now = loop.time()
            if now > due:
                self.overruns += 1
                due = now
            await asyncio.sleep(due - now)

    def _land(self, results: list[ScrapeResult]) -> None:
        self.rounds += 1
        self._datastore.record(results)
        if self._datastore.snapshot.panic:
            self.panic_rounds += 1
        if self._listeners:
            for result in results:
                identity = self._datastore.identity(result.address)
                if identity is None:
                    continue
                for listener in self._listeners:
                    listener(identity, result)
