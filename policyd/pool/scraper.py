"""Scrape rounds: every pod's metrics fetched at once, bounded by one timeout.

A round starts a GET on every pod, waits until all have answered or the
timeout passes, abandons the stragglers and parses what came back. The pool
runs one round per interval; with the timeout shorter than the interval,
rounds never overlap and a pod that stops answering is reported failed by the
first round that starts after its last answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from policyd.pool.discovery import split_address
from policyd.pool.exposition import ExpositionError, MetricsParser, PodMetrics
from policyd.pool.metric_names import VLLM, MetricNames
from policyd.pool.metrics_client import MetricsEndpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    """How pods are scraped and when their metrics count as stale.

    ``timeout`` defaults to three quarters of ``interval`` (it may not exceed
    it), ``stale_after`` to five intervals. ``include_stale`` keeps pods whose
    last scrape failed or is too old among the candidates (policies can then
    judge ``pod.metrics_age`` themselves); pods that never answered are never
    candidates, their zeros would make them look idle.

    ``filter_families`` asks the server for only the families the pool reads
    (``?name[]=...``, the filter prometheus_client's exposition apps
    understand: a server that honours it renders a few hundred bytes instead
    of tens of KB of histograms ten times a second). A server that ignores
    the query sends its whole page, which is read just the same; one whose
    answer lacks a needed family (prometheus_client before 0.25 in
    multiprocess mode returns nothing) is asked for its whole page instead.

    ``in_process`` runs the rounds on the pool's own event loop instead of in
    a scraper child process (``policyd.pool.scrape_process``): the serving
    process then pays the scraping's CPU and its parsing stalls (the default
    keeps both off the serving loop).
    """

    interval: float = 0.1
    timeout: float | None = None
    stale_after: float | None = None
    include_stale: bool = False
    metrics: MetricNames = field(default=VLLM)
    metrics_port: int | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    filter_families: bool = True
    in_process: bool = False

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

    @property
    def request_timeout(self) -> float:
        return self.interval * 0.75 if self.timeout is None else self.timeout

    @property
    def stale_threshold(self) -> float:
        return self.interval * 5 if self.stale_after is None else self.stale_after

    @property
    def request_target(self) -> str:
        """The path (and query) each scrape requests."""
        path = self.metrics.path
        if not self.filter_families:
            return path
        query = "&".join(
            "name%5B%5D=" + urllib.parse.quote(name, safe="")
            for name in self.metrics.family_names()
        )
        return f"{path}{'&' if '?' in path else '?'}{query}"


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
    """What the pool needs of a scraper: ``Scraper`` here, ``ProcessScraper`` in a child."""

    async def scrape(self, addresses: Sequence[str]) -> list[ScrapeResult]:
        """One result per address, in order, within about one interval."""

    def retain(self, addresses: Iterable[str]) -> None:
        """Forget (and disconnect from) every pod not in ``addresses``."""

    async def close(self) -> None:
        """Release every connection (and process) the scraper holds."""


class Scraper:
    """Runs scrape rounds on the running event loop; keeps one endpoint
    (and connection) per pod address."""

    def __init__(self, config: ScrapeConfig) -> None:
        self._config = config
        self._parser = MetricsParser(config.metrics)
        self._target = config.request_target
        self._whole_page = config.metrics.path
        self._endpoints: dict[str, MetricsEndpoint] = {}
        self._hints: dict[str, list[int]] = {}  # where each pod prints each family

    async def scrape(self, addresses: Sequence[str]) -> list[ScrapeResult]:
        """Scrape every address once, concurrently, within the request timeout."""
        if not addresses:
            return []
        results: dict[str, ScrapeResult] = {}
        all_answered = asyncio.get_running_loop().create_future()
        remaining = len(addresses)

        def answered(address: str, endpoint: MetricsEndpoint) -> None:
            nonlocal remaining
            result = self._result(address, endpoint)
            if result is None:  # to be asked again, for the whole page
                endpoint.fetch(functools.partial(answered, address))
                return
            results[address] = result
            remaining -= 1
            if remaining == 0 and not all_answered.done():
                all_answered.set_result(None)

        endpoints = [self._endpoint(address) for address in addresses]
        for address, endpoint in zip(addresses, endpoints, strict=True):
            endpoint.fetch(functools.partial(answered, address))
        timeout = self._config.request_timeout
        try:
            async with asyncio.timeout(timeout):
                await all_answered
        except TimeoutError:
            reason = f"no answer within {timeout * 1000:.0f} ms"
            for endpoint in endpoints:
                endpoint.abandon(reason)
        return [results[address] for address in addresses]

    def retain(self, addresses: Iterable[str]) -> None:
        """Close the connections of pods that are gone.

        A pod may leave while a round is scraping it: its request is abandoned
        (the round gets its result at once) rather than left to the timeout.
        """
        keep = set(addresses)
        for address in [a for a in self._endpoints if a not in keep]:
            endpoint = self._endpoints.pop(address)
            endpoint.abandon("the pod left the pool")
            endpoint.close()
            self._hints.pop(address, None)

    async def close(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.close()
        self._endpoints.clear()
        self._hints.clear()

    def _endpoint(self, address: str) -> MetricsEndpoint:
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            host, port = split_address(address)
            config = self._config
            endpoint = MetricsEndpoint(
                host, config.metrics_port or port, self._target, config.max_body_bytes
            )
            self._endpoints[address] = endpoint
            self._hints[address] = self._parser.new_hints()
        return endpoint

    def _result(self, address: str, endpoint: MetricsEndpoint) -> ScrapeResult | None:
        """The outcome of a finished request (parsed now, while the body is in
        the connection's buffer), or ``None`` when it was asked again."""
        body = endpoint.body
        if body is None:
            return ScrapeResult(address, None, endpoint.error or "no answer", endpoint.latency)
        try:
            metrics = self._parser.parse(body.data, self._hints[address], body.start, body.end)
        except ExpositionError as error:
            if error.missing and endpoint.target != self._whole_page:
                # Some servers answer a family filter with less than asked for
                # (prometheus_client before 0.25 in multiprocess mode sends
                # nothing): ask this pod for its whole page from now on.
                log.info(
                    "pod %s: %s when asked for families; asking for the whole page", address, error
                )
                endpoint.target = self._whole_page
                return None
            return ScrapeResult(address, None, f"bad metrics: {error}", endpoint.latency)
        return ScrapeResult(address, metrics, None, endpoint.latency)
