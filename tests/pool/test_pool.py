"""The running pool: discovery + scraping + snapshots, against stand-in pods on loopback.

Every test that scrapes runs twice: with the scraper child process (the
default) and with the rounds on the test's own event loop (``in_process``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from policyd.pool import DiscoveryError, Pool, PoolSnapshot, ScrapeConfig, StaticFileDiscovery
from policyd.pool.discovery import PodIdentity
from policyd.pool.scraper import ScrapeResult

from .model_server import MetricsServer, vllm_text


class PushedDiscovery:
    """A discovery source the test feeds by hand (the pool's own interface)."""

    def __init__(self, *first: PodIdentity) -> None:
        self._sets: asyncio.Queue[tuple[PodIdentity, ...]] = asyncio.Queue()
        self.push(*first)

    def push(self, *pods: PodIdentity) -> None:
        self._sets.put_nowait(tuple(pods))

    async def updates(self) -> AsyncIterator[tuple[PodIdentity, ...]]:
        while True:
            yield await self._sets.get()


Scraping = Callable[..., ScrapeConfig]


@pytest.fixture(params=["child process", "in process"])
def scraping(request: pytest.FixtureRequest) -> Scraping:
    """``ScrapeConfig`` with the scraper under test; by default a round every 0.5 s with
    as long a timeout, which a pod on loopback meets even on a loaded machine."""

    def config(**settings: float) -> ScrapeConfig:
        in_process = request.param == "in process"
        settings = settings or {"interval": 0.5, "timeout": 0.5}
        return ScrapeConfig(in_process=in_process, **settings)  # type: ignore[arg-type]

    return config


async def serve(servers: list[MetricsServer], **gauges: float) -> MetricsServer:
    server = MetricsServer(vllm_text(**gauges))  # type: ignore[arg-type]
    await server.start()
    servers.append(server)
    return server


def identity(server: MetricsServer, name: str) -> PodIdentity:
    return PodIdentity.of(name, server.address, {"pool": "test"})


async def until(pool: Pool, condition: object, timeout: float = 30.0) -> PoolSnapshot:
    """The first snapshot satisfying ``condition`` (polled like a request would); the
    generous bound fails only what never happens."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        snapshot = pool.snapshot()
        if condition(snapshot):  # type: ignore[operator]
            return snapshot
        await asyncio.sleep(0.005)
    raise AssertionError(f"condition not met within {timeout} s: {pool.snapshot()}")


def candidate_names(snapshot: PoolSnapshot) -> set[str]:
    return {pod.name for pod in snapshot.candidates}


async def test_the_pool_becomes_ready_with_every_pod_scraped(
    servers: list[MetricsServer],
    scraping: Scraping,
) -> None:
    a = await serve(servers, waiting=1, running=2, kv_cache=0.3, running_loras="x,y")
    b = await serve(servers, waiting=4, running=0, kv_cache=0.9)
    config = scraping()
    async with Pool(PushedDiscovery(identity(a, "a"), identity(b, "b")), config) as pool:
        assert await pool.wait_ready(timeout=30)
        snapshot = pool.snapshot()
        assert snapshot.ready
        assert candidate_names(snapshot) == {"a", "b"}
        pod_a, pod_b = snapshot.pods
        assert (pod_a.waiting_queue, pod_a.running, pod_a.kv_cache) == (1, 2, 0.3)
        assert pod_a.active_loras == ("x", "y") and pod_a.max_loras == 4
        assert (pod_b.waiting_queue, pod_b.kv_cache) == (4, 0.9)
        assert pod_a.metrics_age.seconds() <= config.stale_threshold  # a candidate is fresh
        later = await until(pool, lambda s: s.scrape_round >= snapshot.scrape_round + 3)
        assert later.version > snapshot.version
        assert pool.stats[a.address].successes >= 3
        assert pool.stats[a.address].last_latency is not None


async def test_metrics_changes_show_up_in_the_next_snapshots(
    servers: list[MetricsServer],
    scraping: Scraping,
) -> None:
    a = await serve(servers, waiting=0)
    async with Pool(PushedDiscovery(identity(a, "a")), scraping()) as pool:
        assert await pool.wait_ready(timeout=30)
        a.text = vllm_text(waiting=7, running_loras="hot")
        snapshot = await until(pool, lambda s: s.pods[0].waiting_queue == 7)
        assert snapshot.pods[0].active_loras == ("hot",)


async def test_a_pod_that_hangs_leaves_the_candidates_within_two_intervals(
    servers: list[MetricsServer],
    caplog: pytest.LogCaptureFixture,
    scraping: Scraping,
) -> None:
    a = await serve(servers)
    b = await serve(servers)
    # Rounds every interval, each request cut at the timeout: the first round
    # after b's last answer takes it out, within two intervals of it. The test
    # counts rounds, not seconds, so a loaded machine cannot fail it.
    config = scraping(interval=1.0, timeout=1.0)
    async with Pool(PushedDiscovery(identity(a, "a"), identity(b, "b")), config) as pool:
        assert await pool.wait_ready(timeout=30)
        await until(pool, lambda s: candidate_names(s) == {"a", "b"})
        b.hang()
        gone = await until(pool, lambda s: "b" not in candidate_names(s))
        assert gone.scrape_round == pool.stats[b.address].last_success_round + 1
        assert candidate_names(gone) == {"a"}
        assert pool.stats[b.address].last_error == "no answer within 1000 ms"
    assert "metrics scrape of pod b" in caplog.text


async def test_when_every_pod_hangs_the_last_heard_stay_candidates_until_stale(
    servers: list[MetricsServer],
    scraping: Scraping,
) -> None:
    a = await serve(servers)
    b = await serve(servers)
    config = scraping(interval=0.5, timeout=0.5, stale_after=5.0)
    async with Pool(PushedDiscovery(identity(a, "a"), identity(b, "b")), config) as pool:
        await until(pool, lambda s: candidate_names(s) == {"a", "b"} and not s.panic)
        before = pool.panic_rounds
        a.hang()
        b.hang()
        panicked = await until(pool, lambda s: s.panic)
        assert candidate_names(panicked) == {"a", "b"}
        assert pool.panic_rounds > before
        emptied = await until(pool, lambda s: not s.candidates)
        assert not emptied.panic
        assert min(pod.metrics_age.seconds() for pod in emptied.pods) > 5.0


async def test_with_panic_off_a_round_no_pod_answers_empties_the_candidates(
    servers: list[MetricsServer],
    scraping: Scraping,
) -> None:
    a = await serve(servers)
    stale_after = 60.0  # far beyond the test: the failed round emptied the candidates
    config = scraping(interval=0.5, timeout=0.5, stale_after=stale_after, panic=False)
    async with Pool(PushedDiscovery(identity(a, "a")), config) as pool:
        await until(pool, lambda s: candidate_names(s) == {"a"})
        a.hang()
        emptied = await until(pool, lambda s: not s.candidates)
        assert not emptied.panic
        assert pool.panic_rounds == 0
        assert max(pod.metrics_age.seconds() for pod in emptied.pods) < stale_after


async def test_a_pod_that_goes_away_leaves_and_rejoins_when_back(
    servers: list[MetricsServer],
    scraping: Scraping,
) -> None:
    a = await serve(servers)
    b = await serve(servers)
    config = scraping(interval=1.0, timeout=1.0)
    async with Pool(PushedDiscovery(identity(a, "a"), identity(b, "b")), config) as pool:
        await until(pool, lambda s: candidate_names(s) == {"a", "b"})
        port = int(b.address.rsplit(":", 1)[1])
        await b.stop()
        gone = await until(pool, lambda s: "b" not in candidate_names(s))
        # The first round after b's last answer took it out.
        assert gone.scrape_round == pool.stats[b.address].last_success_round + 1
        assert "b" in {pod.name for pod in gone.pods}  # known, just not a candidate
        revived = MetricsServer(vllm_text(running=9))
        await revived.start(port)
        servers.append(revived)
        back = await until(pool, lambda s: "b" in candidate_names(s))
        assert back.pods[1].running == 9


async def test_discovery_changes_add_and_drop_pods_and_their_counters(
    servers: list[MetricsServer],
    scraping: Scraping,
) -> None:
    a = await serve(servers)
    b = await serve(servers)
    discovery = PushedDiscovery(identity(a, "a"))
    async with Pool(discovery, scraping()) as pool:
        assert await pool.wait_ready(timeout=30)
        pool.snapshot().pods[0].load.count = 2
        discovery.push(identity(a, "a"), identity(b, "b"))
        both = await until(pool, lambda s: candidate_names(s) == {"a", "b"})
        assert both.pods[0].in_flight == 2
        discovery.push(identity(b, "b"))
        only_b = await until(pool, lambda s: [p.name for p in s.pods] == ["b"])
        assert only_b.candidates[0].in_flight == 0
        discovery.push(identity(a, "a"), identity(b, "b"))
        again = await until(pool, lambda s: candidate_names(s) == {"a", "b"})
        assert again.pods[0].in_flight == 0


async def test_listeners_see_every_scrape_result(
    servers: list[MetricsServer], scraping: Scraping
) -> None:
    a = await serve(servers)
    seen: list[tuple[str, ScrapeResult]] = []
    async with Pool(PushedDiscovery(identity(a, "a")), scraping()) as pool:
        pool.add_listener(lambda pod, result: seen.append((pod.name, result)))
        await until(pool, lambda s: s.scrape_round >= 3)
    assert len(seen) >= 2
    assert all(name == "a" and result.ok for name, result in seen)


async def test_wait_ready_times_out_without_pods(scraping: Scraping) -> None:
    async with Pool(PushedDiscovery(), scraping()) as pool:
        assert not await pool.wait_ready(timeout=0.3)
        assert not pool.snapshot().ready


async def test_a_static_file_drives_the_pool_end_to_end(
    servers: list[MetricsServer],
    tmp_path: Path,
    scraping: Scraping,
) -> None:
    a = await serve(servers, running=1)
    b = await serve(servers, running=2)
    pods = tmp_path / "pods.yaml"
    pods.write_text(f"pods:\n  - name: a\n    address: {a.address}\n")
    async with Pool(StaticFileDiscovery(pods, poll_interval=0.05), scraping()) as pool:
        assert await pool.wait_ready(timeout=30)
        assert candidate_names(pool.snapshot()) == {"a"}
        pods.write_text(
            f"pods:\n  - name: a\n    address: {a.address}\n"
            f"  - name: b\n    address: {b.address}\n    labels: {{tier: gold}}\n"
        )
        snapshot = await until(pool, lambda s: candidate_names(s) == {"a", "b"})
        assert dict(snapshot.pods[1].labels) == {"tier": "gold"}


async def test_a_bad_pod_file_at_start_fails_start(tmp_path: Path) -> None:
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods:\n  - name: a\n    address: nowhere\n")
    pool = Pool(StaticFileDiscovery(pods))
    with pytest.raises(DiscoveryError, match=r"pods.yaml:3: address 'nowhere'"):
        await pool.start()
    await pool.stop()


async def test_stop_closes_everything_it_started(
    servers: list[MetricsServer],
    caplog: pytest.LogCaptureFixture,
    scraping: Scraping,
) -> None:
    caplog.set_level(logging.ERROR)
    a = await serve(servers)
    pool = Pool(PushedDiscovery(identity(a, "a")), scraping())
    await pool.start()
    assert await pool.wait_ready(timeout=30)
    await pool.stop()
    requests = a.requests
    await asyncio.sleep(0.3)
    assert a.requests == requests  # no scraping after stop
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("pool-")]
    assert caplog.records == []
