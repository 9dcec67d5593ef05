"""The pool's state, published as immutable snapshots swapped by one reference.

Requests read ``Datastore.snapshot`` and use it as long as they like; nothing
they hold ever changes under them and no reader takes a lock. The writers (the
discovery follower and the scrape loop) run on the same event loop, build a
new ``PoolSnapshot`` and swap it in. What must outlive snapshots, the in-flight
count per pod and its scrape statistics, lives in per-address state that the
snapshots point to.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from policyd.cel.values import NANOS_PER_SECOND, ZERO_DURATION, Duration
from policyd.fields.roles import ROLE_LABEL, role_of
from policyd.pool.discovery import PodIdentity
from policyd.pool.exposition import NO_METRICS, PodMetrics
from policyd.pool.pod import EMPTY_SNAPSHOT, InFlight, Pod, PoolSnapshot
from policyd.pool.scraper import ScrapeResult

__all__ = ["EMPTY_SNAPSHOT", "Datastore", "PoolSnapshot", "ScrapeStats"]

log = logging.getLogger(__name__)

# A failing pod's reason is logged at most once per this many seconds.
FAILURE_LOG_INTERVAL: Final = 30.0


@dataclass(slots=True)
class ScrapeStats:
    """One pod's scrape record, updated in place every round (for telemetry).

    Times are ``time.monotonic()`` seconds; latencies are seconds.
    """

    successes: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    last_latency: float | None = None
    last_error: str | None = None
    last_success_at: float | None = None
    last_success_round: int = 0


class _Member:
    """What the datastore keeps per pod address between snapshots."""

    __slots__ = (
        "discovered_at",
        "identity",
        "last_ok",
        "load",
        "logged_at",
        "logged_error",
        "metrics",
        "pod",
        "published",
        "stats",
        "unlogged",
    )

    def __init__(self, identity: PodIdentity, now: float) -> None:
        self.identity = identity
        self.load = InFlight()
        self.metrics: PodMetrics | None = None
        self.last_ok = False
        self.discovered_at = now
        self.stats = ScrapeStats()
        self.pod: Pod | None = None  # as last published
        self.published: PodMetrics | None = None  # the metrics ``pod`` was built from
        # The failure log of this pod (``Datastore._log_failure``): the reason
        # last logged while it fails (None: not failing as far as the log
        # said), when that line was, failed scrapes since that were not logged.
        self.logged_error: str | None = None
        self.logged_at = -math.inf
        self.unlogged = 0


class Datastore:
    """Holds the pod set and their last metrics; publishes ``snapshot``."""

    def __init__(
        self,
        *,
        stale_after: float,
        include_stale: bool = False,
        panic: bool = True,
        clock: Callable[[], float] = time.monotonic,
        on_publish: Callable[[PoolSnapshot], None] | None = None,
        failure_log_interval: float = FAILURE_LOG_INTERVAL,
        role_label: str = ROLE_LABEL,
    ) -> None:
        self._stale_after = stale_after
        self._role_label = role_label
        self._failure_log_interval = failure_log_interval
        self._include_stale = include_stale
        self._panic_allowed = panic
        self._clock = clock
        self._on_publish = on_publish
        self._members: dict[str, _Member] = {}
        self._version = 0
        self._round = 0
        self._ready = False
        self.snapshot: PoolSnapshot = EMPTY_SNAPSHOT

    @property
    def stats(self) -> Mapping[str, ScrapeStats]:
        """Scrape statistics per pod address (live objects, read-only view)."""
        return MappingProxyType({a: m.stats for a, m in self._members.items()})

    def addresses(self) -> list[str]:
        return list(self._members)

    def identity(self, address: str) -> PodIdentity | None:
        member = self._members.get(address)
        return None if member is None else member.identity

    def set_pods(self, identities: Iterable[PodIdentity]) -> None:
        """Replace the pod set. A pod that stays (same address) keeps its
        metrics, in-flight counter and statistics; a pod that left loses them."""
        now = self._clock()
        members: dict[str, _Member] = {}
        for identity in sorted(identities, key=lambda i: (i.name, i.address)):
            if identity.address in members:
                continue  # sources never repeat an address; if one did, the first name wins
            member = self._members.get(identity.address)
            if member is None:
                member = _Member(identity, now)
            else:
                member.identity = identity
            members[identity.address] = member
        self._members = members
        self._publish(now)

    def record(self, results: Iterable[ScrapeResult]) -> None:
        """Take in one scrape round and publish the snapshot it makes."""
        now = self._clock()
        self._round += 1
        for result in results:
            member = self._members.get(result.address)
            if member is None:  # left while the round ran
                continue
            stats = member.stats
            stats.last_latency = result.latency
            if result.metrics is not None:
                if member.logged_error is not None:
                    log.info(
                        "pod %s (%s) answers its metrics scrape again, after %d failed",
                        member.identity.name,
                        result.address,
                        stats.consecutive_failures,
                    )
                    member.logged_error = None
                member.metrics = result.metrics
                member.last_ok = True
                stats.successes += 1
                stats.consecutive_failures = 0
                stats.last_error = None
                stats.last_success_at = now
                stats.last_success_round = self._round
            else:
                member.last_ok = False
                stats.failures += 1
                stats.consecutive_failures += 1
                stats.last_error = result.error
                self._log_failure(member, result.error or "no reason given", now)
        self._publish(now)

    def _log_failure(self, member: _Member, reason: str, now: float) -> None:
        """Log a failed scrape of one pod: when it starts failing, when its
        reason changes, never more than once per ``failure_log_interval``.

        Each pod is logged on its own, so that no pod's reason goes unseen
        when many fail at once; the interval keeps a pod that flaps or whose
        reason keeps changing to a line (and a recovery) per interval. The
        failures not logged are counted in the next line.
        """
        if reason == member.logged_error or now - member.logged_at < self._failure_log_interval:
            member.unlogged += 1
            return
        identity = member.identity
        if member.unlogged:
            log.warning(
                "metrics scrape of pod %s (%s) failed: %s (%d failed scrapes not logged since"
                " the last line about it)",
                identity.name,
                identity.address,
                reason,
                member.unlogged,
            )
        else:
            log.warning(
                "metrics scrape of pod %s (%s) failed: %s", identity.name, identity.address, reason
            )
        member.logged_error = reason
        member.logged_at = now
        member.unlogged = 0

    def _publish(self, now: float) -> None:
        """Publish the pool as of ``now``.

        A pod that answered with the same metrics as last round (most pods,
        most rounds: their age is zero each time) keeps its ``Pod`` object,
        and when every candidate is unchanged the candidates tuple is the
        same object as before, so that what policies worked out over it
        (the router's reused walks) stays valid until something changes.

        Panic: when no pod answered the last round but some answered within
        the stale threshold, those are the candidates. One pod failing says
        that pod is in trouble, and it leaves at once; every pod failing the
        same round says more often that the scraper or its network is (a
        starved host, a burst that slows every model server's /metrics at
        once), and answering 503 to every request then turns a blip into an
        outage. Envoy's panic threshold makes the same trade. Pods that stay
        silent past the threshold leave anyway. With ``panic=False`` (``policyd
        serve --no-panic``) a failed round leaves no candidates: requests get a
        503 until pods answer again, for operators who would rather shed than
        route on metrics one round old.
        """
        previous = self.snapshot
        pods: list[Pod] = []
        candidates: list[Pod] = []
        recent: list[Pod] = []  # answered within the stale threshold, maybe not last round
        all_tried = True
        for address, member in self._members.items():
            identity = member.identity
            metrics = member.metrics or NO_METRICS
            scraped_at = member.stats.last_success_at
            age = max(now - (member.discovered_at if scraped_at is None else scraped_at), 0.0)
            pod = member.pod
            if pod is None or not _unchanged(pod, member.published, identity, metrics, age):
                # The scraped fields go in the order PodMetrics holds them.
                pod = member.pod = Pod(
                    identity.name,
                    address,
                    identity.labels,
                    identity.role or role_of(identity.labels, self._role_label),
                    *metrics,
                    # Just scraped, the commonest case: no Duration to make.
                    metrics_age=ZERO_DURATION if age == 0.0 else Duration.from_seconds(age),
                    load=member.load,
                )
                member.published = metrics
            pods.append(pod)
            if member.metrics is not None and (self._include_stale or age <= self._stale_after):
                recent.append(pod)
                if member.last_ok or self._include_stale:
                    candidates.append(pod)
            all_tried = all_tried and (member.stats.successes + member.stats.failures) > 0
        self._ready = bool(self._members) and (self._ready or all_tried)
        panic = self._panic_allowed and not candidates and bool(recent)
        if panic:
            candidates = recent
        if panic != previous.panic:
            if panic:
                log.warning(
                    "no pod answered the last metrics scrape: routing on the %d pods whose"
                    " metrics are at most %.3g s old until they answer again or go stale",
                    len(recent),
                    self._stale_after,
                )
            elif candidates:
                log.info("pods answer metrics scrapes again; panic over")
            else:
                log.warning("no pod answered its metrics scrape within %.3g s", self._stale_after)
        self._version += 1
        self.snapshot = PoolSnapshot(
            version=self._version,
            pods=_same_or_new(previous.pods, pods),
            candidates=_same_or_new(previous.candidates, candidates),
            ready=self._ready,
            taken_at=now,
            scrape_round=self._round,
            panic=panic,
        )
        if self._on_publish is not None:
            self._on_publish(self.snapshot)


def _unchanged(
    pod: Pod, published: PodMetrics | None, identity: PodIdentity, metrics: PodMetrics, age: float
) -> bool:
    """Whether ``pod`` (built from ``published``) shows this identity, these metrics and age."""
    return (
        pod.name == identity.name
        and pod.labels is identity.labels
        and pod.metrics_age.nanos == round(age * NANOS_PER_SECOND)
        and published == metrics
    )


def _same_or_new(old: tuple[Pod, ...], pods: list[Pod]) -> tuple[Pod, ...]:
    """``old`` itself when it holds exactly these pod objects, else a new tuple."""
    if len(old) == len(pods) and all(a is b for a, b in zip(old, pods, strict=True)):
        return old
    return tuple(pods)
