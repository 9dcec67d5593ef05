"""Scrape rounds: every pod's metrics fetched at once, bounded by one timeout.

A round starts a GET on every pod, parses each answer as it completes and
ends when all have answered or the timeout passes, abandoning the stragglers. The pool
runs one round per interval; with the timeout shorter than the interval,
rounds never overlap and a pod that stops answering is reported failed by the
first round that starts after its last answer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from policyd.pool.discovery import split_address
from policyd.pool.exposition import ExpositionError, MetricsParser, PodMetrics
from policyd.pool.metric_names import PRESET_LABEL, PRESETS, VLLM, MetricNames, preset_named
from policyd.pool.metrics_client import MetricsClient, MetricsEndpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    """How pods are scraped and when their metrics count as stale.

    ``timeout`` defaults to three quarters of ``interval`` (it may not exceed
    it), ``stale_after`` to five intervals. ``include_stale`` keeps pods whose
    last scrape failed or is too old among the candidates (policies can then
    judge ``pod.metrics_age`` themselves); pods that never answered are never
    candidates, their zeros would make them look idle. ``panic`` keeps routing
    on the pods heard from within ``stale_after`` when a whole round fails
    (``Datastore``); without it such a round leaves no candidates.

    ``filter_families`` asks the server for only the families the pool reads
    (``?name[]=...``, the filter prometheus_client's exposition apps
    understand: a server that honours it renders a few hundred bytes instead
    of tens of KB of histograms ten times a second). A server that ignores
    the query sends its whole page, which is read just the same; one whose
    answer lacks a needed family (prometheus_client before 0.25 in
    multiprocess mode returns nothing) is asked for its whole page instead.

    ``in_process`` runs the rounds in a thread of the serving process instead
    of in a scraper child process (``policyd.pool.scrape_process``): the
    serving process then pays the scraping's CPU, and the thread holds the
    GIL while it frames and parses (the default keeps both away).

    ``preset`` names the preset ``metrics`` was made from (with the
    operator's overrides): a pod whose ``PRESET_LABEL`` names another preset
    is read with that preset's declared names and path instead (mixed pools).
    """

    interval: float = 0.1
    timeout: float | None = None
    stale_after: float | None = None
    include_stale: bool = False
    panic: bool = True
    metrics: MetricNames = field(default=VLLM)
    metrics_port: int | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    filter_families: bool = True
    in_process: bool = False
    preset: str = "vllm"

    def __post_init__(self) -> None:
        if not self.interval > 0:
            raise ValueError(f"scrape interval must be positive, not {self.interval}")
        if not 0 < self.request_timeout <= self.interval:
            raise ValueError(
                f"scrape timeout {self.request_timeout} must be positive and at most the "
                f"interval {self.interval}, or rounds would overlap"
            )
        if not self.stale_threshold >= self.interval:
            raise ValueError(
                f"stale-after {self.stale_threshold} must be at least the interval {self.interval}"
            )
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError(f"metrics port {self.metrics_port} is not a port number")
        if self.max_body_bytes <= 0:
            raise ValueError("max body bytes must be positive")
        if self.preset not in PRESETS:
            raise ValueError(f"no metrics preset {self.preset!r} (known: {', '.join(PRESETS)})")

    @property
    def request_timeout(self) -> float:
        return self.interval * 0.75 if self.timeout is None else self.timeout

    @property
    def stale_threshold(self) -> float:
        return self.interval * 5 if self.stale_after is None else self.stale_after

    @property
    def request_target(self) -> str:
        """The path (and query) each scrape requests."""
        return self.target_of(self.metrics)

    def target_of(self, metrics: MetricNames) -> str:
        """The path (and query) a scrape of a pod read with ``metrics`` requests."""
        path = metrics.path
        if not self.filter_families:
            return path
        query = "&".join(
            "name%5B%5D=" + urllib.parse.quote(name, safe="") for name in metrics.family_names()
        )
        return f"{path}{'&' if '?' in path else '?'}{query}"


def pod_presets(
    config: ScrapeConfig, labelled: Iterable[tuple[str, Mapping[str, str]]]
) -> dict[str, str]:
    """The label value of each pod (address, labels) read with other names than the
    process's: those whose ``PRESET_LABEL`` names another preset, or none known."""
    presets: dict[str, str] = {}
    for address, labels in labelled:
        value = labels.get(PRESET_LABEL)
        if value is not None and preset_named(value) != config.preset:
            presets[address] = value
    return presets


class _Reading(NamedTuple):
    """How a pod's page is read: its parser, its request target, its whole page's path."""

    parser: MetricsParser
    target: str
    whole_page: str


class ScrapeResult(NamedTuple):
    """One pod's outcome in one round: metrics, or the reason there are none.

    (A named tuple: cheap to make, a thousand a second.)
    """

    address: str
    metrics: PodMetrics | None
    error: str | None
    latency: float  # seconds from the request to the answer, the failure or the timeout

    @property
    def ok(self) -> bool:
        return self.metrics is not None


class ScrapeRounds(Protocol):
    """What the pool needs of a scraper: ``Scraper`` in a thread, ``ProcessScraper`` in a child."""

    async def scrape(
        self, addresses: Sequence[str], presets: Mapping[str, str] | None = None
    ) -> list[ScrapeResult]:
        """One result per address, in order, within about one interval.

        ``presets`` (``pod_presets``): the preset label values of the pods not
        read with the process's names; ``None`` keeps the last ones.
        """

    def retain(self, addresses: Iterable[str]) -> None:
        """Forget (and disconnect from) every pod not in ``addresses``."""

    async def close(self) -> None:
        """Release every connection (and process) the scraper holds."""


class ScrapeLoop:
    """Runs scrape rounds on the calling thread; keeps one endpoint (and
    connection) per pod address.

    The scraper child process runs one on its only thread; ``Scraper`` runs
    one in a thread of the serving process. ``scrape`` and ``close`` must be
    called from one thread at a time; ``retain`` may come from any thread.
    """

    def __init__(self, config: ScrapeConfig) -> None:
        self._config = config
        self._default = _Reading(
            MetricsParser(config.metrics), config.request_target, config.metrics.path
        )
        self._readings: dict[str, _Reading] = {}  # by preset name, made when first used
        self._presets: Mapping[str, str] = {}  # ``pod_presets``
        self._reading_of: dict[str, _Reading] = {}  # the pods read with another preset
        self._unknown: dict[str, str] = {}  # pods whose label names no preset: the reason
        self._client = MetricsClient(config.max_body_bytes)
        self._endpoints: dict[str, MetricsEndpoint] = {}
        self._lock = threading.Lock()  # guards the two fields below
        self._running = False
        self._keep: set[str] | None = None  # a retain that came while a round ran

    def set_presets(self, presets: Mapping[str, str]) -> None:
        """The preset label values of the pods read with other names (``pod_presets``).

        A pod whose preset changed is connected to again; a pod whose label
        names no preset is not scraped, its result says why.
        """
        if presets == self._presets:
            return
        self._presets = dict(presets)
        self._unknown = {}
        reading_of: dict[str, _Reading] = {}
        for address, value in self._presets.items():
            name = preset_named(value)
            if name is None:
                known = ", ".join(sorted(PRESETS))
                self._unknown[address] = (
                    f"label {PRESET_LABEL}={value!r} names no metrics preset (known: {known})"
                )
            else:
                reading_of[address] = self._reading(name)
        for address, endpoint in list(self._endpoints.items()):
            if reading_of.get(address) is not self._reading_of.get(address):
                del self._endpoints[address]
                endpoint.abandon("the pod's metrics preset changed")
                endpoint.close()
        self._reading_of = reading_of

    def _reading(self, name: str) -> _Reading:
        reading = self._readings.get(name)
        if reading is None:
            metrics = PRESETS[name]
            reading = _Reading(
                MetricsParser(metrics), self._config.target_of(metrics), metrics.path
            )
            self._readings[name] = reading
        return reading

    def scrape(
        self, addresses: Sequence[str], presets: Mapping[str, str] | None = None
    ) -> list[ScrapeResult]:
        """Scrape every address once, concurrently, within the request timeout.

        ``presets`` as for ``set_presets``; ``None`` keeps the last ones.
        """
        if not addresses:
            return []
        if presets is not None:
            self.set_presets(presets)
        results: dict[str, ScrapeResult] = {}
        unknown = self._unknown
        if unknown:
            for address in addresses:
                if address in unknown:
                    results[address] = ScrapeResult(address, None, unknown[address], 0.0)
            fetched = [address for address in addresses if address not in unknown]
        else:
            fetched = list(addresses)

        def done(endpoint: MetricsEndpoint) -> bool:
            result = self._result(endpoint)
            if result is None:  # to be asked again, for the whole page
                return True
            results[endpoint.key] = result
            return False

        with self._lock:
            self._running = True
        try:
            endpoints = [self._endpoint(address) for address in fetched]
            self._client.fetch(endpoints, self._config.request_timeout, done, self._retain_now)
        finally:
            with self._lock:
                self._running = False
            self._retain_now()
        return [results[address] for address in addresses]

    def retain(self, addresses: Iterable[str]) -> None:
        """Close the connections of pods that are gone.

        A pod may leave while a round is scraping it: its request is abandoned
        (the round gets its result at once) rather than left to the timeout.
        """
        keep = set(addresses)
        with self._lock:
            if not self._running:
                self._forget_all_but(keep)
                return
            self._keep = keep
        self._client.wake()  # the round's thread applies it

    def close(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.close()
        self._endpoints.clear()
        self._client.close()

    def _retain_now(self) -> None:
        with self._lock:
            keep, self._keep = self._keep, None
        if keep is not None:
            self._forget_all_but(keep)

    def _forget_all_but(self, keep: set[str]) -> None:
        for address in [a for a in self._endpoints if a not in keep]:
            endpoint = self._endpoints.pop(address)
            endpoint.abandon("the pod left the pool")
            endpoint.close()

    def _endpoint(self, address: str) -> MetricsEndpoint:
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            host, port = split_address(address)
            port = self._config.metrics_port or port
            target = self._reading_of.get(address, self._default).target
            endpoint = self._client.endpoint(address, host, port, target)
            self._endpoints[address] = endpoint
        return endpoint

    def _result(self, endpoint: MetricsEndpoint) -> ScrapeResult | None:
        """The outcome of a finished request (parsed now, while the body is in
        the connection's buffer), or ``None`` when it is to be asked again."""
        address = endpoint.key
        body = endpoint.body
        if body is None:
            return ScrapeResult(address, None, endpoint.error or "no answer", endpoint.latency)
        reading = (
            self._reading_of.get(address, self._default) if self._reading_of else self._default
        )
        try:
            metrics = reading.parser.parse(body.data, body.start, body.end)
        except ExpositionError as error:
            if error.missing and endpoint.target != reading.whole_page:
                # Some servers answer a family filter with less than asked for
                # (prometheus_client before 0.25 in multiprocess mode sends
                # nothing): ask this pod for its whole page from now on.
                log.info(
                    "pod %s: %s when asked for families; asking for the whole page", address, error
                )
                endpoint.target = reading.whole_page
                return None
            return ScrapeResult(address, None, f"bad metrics: {error}", endpoint.latency)
        return ScrapeResult(address, metrics, None, endpoint.latency)


class Scraper:
    """Scrape rounds for the serving process itself (``ScrapeConfig.in_process``).

    A ``ScrapeLoop`` in a thread of its own: the event loop only awaits each
    round's results, and the HTTP client is the same one the scraper child
    process runs. Must be used on one event loop.
    """

    def __init__(self, config: ScrapeConfig) -> None:
        self._rounds = ScrapeLoop(config)
        self._thread: ThreadPoolExecutor | None = ThreadPoolExecutor(
            1, thread_name_prefix="policyd-scrape"
        )

    async def scrape(
        self, addresses: Sequence[str], presets: Mapping[str, str] | None = None
    ) -> list[ScrapeResult]:
        """Scrape every address once, concurrently, within the request timeout."""
        if not addresses or self._thread is None:
            return []
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._thread, self._rounds.scrape, list(addresses), presets
        )

    def retain(self, addresses: Iterable[str]) -> None:
        """Close the connections of pods that are gone (a round still scraping one
        ends its request at once)."""
        self._rounds.retain(addresses)

    async def close(self) -> None:
        """Close every connection, after the round running (if any) ends."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        await asyncio.get_running_loop().run_in_executor(thread, self._rounds.close)
        thread.shutdown()
