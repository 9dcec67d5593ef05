"""The scraper child process, over real loopback HTTP, against stand-in model-server pods.

The child is the real one (``python -m policyd.pool.scrape_child``); the tests
kill it, stop it and take its parent away as an operator or the kernel would.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest

from policyd.pool import Pool, PoolSnapshot, ScrapeConfig
from policyd.pool.discovery import PodIdentity
from policyd.pool.exposition import PodMetrics
from policyd.pool.scrape_process import ProcessScraper, answer_timeout
from policyd.pool.scraper import Scraper, ScrapeResult

from .model_server import VLLM_SAMPLE, MetricsServer, vllm_text
from .test_scraper import (
    BODY,
    RawServer,
    answering_until_closed,
    peer_recording_server,
    read_request,
    serve,
)

# Generous timeouts: a pod on loopback and the child answer a round in
# milliseconds, but a loaded machine may keep either from a core for a while.
CONFIG = ScrapeConfig(interval=5.0, timeout=5.0, stale_after=10.0)
# For the tests that wait for rounds to go unanswered: answers are due 4 s
# (the stale threshold) after a round starts, room for a child just woken on
# a loaded machine to work through the rounds it missed.
SHORT = ScrapeConfig(interval=2.0, timeout=2.0, stale_after=4.0)


@pytest.fixture
async def scraper() -> AsyncIterator[ProcessScraper]:
    started = ProcessScraper(CONFIG)
    yield started
    await started.close()


@pytest.fixture
async def short_scraper() -> AsyncIterator[ProcessScraper]:
    started = ProcessScraper(SHORT)
    yield started
    await started.close()


def outcome(results: Sequence[ScrapeResult]) -> list[tuple[str, object, str | None]]:
    """The results without their latencies (which differ from run to run)."""
    return [(r.address, r.metrics, r.error) for r in results]


async def rounds_until(
    scraper: ProcessScraper,
    addresses: list[str],
    done: Callable[[list[ScrapeResult]], bool],
    timeout: float = 30.0,
) -> list[list[ScrapeResult]]:
    """Every round's results, a round every 0.1 s, up to the first that is ``done``."""
    rounds: list[list[ScrapeResult]] = []
    async with asyncio.timeout(timeout):
        while not rounds or not done(rounds[-1]):
            rounds.append(await scraper.scrape(addresses))
            await asyncio.sleep(0.1)
    return rounds


def all_ok(results: list[ScrapeResult]) -> bool:
    return all(result.ok for result in results)


def process_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


@pytest.mark.parametrize(
    ("settings", "seconds"),
    [
        ({}, 0.5),  # the stale threshold, 5 intervals
        ({"interval": 0.2, "stale_after": 0.4}, 0.4),
        ({"interval": 0.2, "stale_after": 0.2}, 0.35),  # timeout 0.15 + one interval
        ({"interval": 0.2, "timeout": 0.2, "stale_after": 0.3}, 0.4),
    ],
)
def test_a_round_waits_for_the_child_up_to_the_stale_threshold(
    settings: dict[str, float], seconds: float
) -> None:
    assert answer_timeout(ScrapeConfig(**settings)) == pytest.approx(seconds)  # type: ignore[arg-type]


async def test_results_equal_the_in_process_scrapers_on_the_same_pods(
    servers: list[MetricsServer], scraper: ProcessScraper
) -> None:
    pods = [
        await serve(servers, vllm_text(waiting=i, running=3 * i, kv_cache=i / 8, running_loras="a"))
        for i in range(3)
    ]
    broken = await serve(servers, VLLM_SAMPLE.replace("} 3.0", "} three"))
    failing = await serve(servers)
    failing.status = 503
    gone = await serve(servers)
    await gone.stop()
    addresses = [pod.address for pod in (*pods, broken, failing, gone)]
    in_process = Scraper(CONFIG)
    try:
        for _ in range(2):  # the second round reuses connections
            theirs = await in_process.scrape(addresses)
            ours = await scraper.scrape(addresses)
            assert outcome(ours) == outcome(theirs)
    finally:
        await in_process.close()
    assert [r.ok for r in ours] == [True, True, True, False, False, False]
    assert all(type(r) is ScrapeResult for r in ours)
    assert all(type(r.metrics) is PodMetrics for r in ours[:3])
    assert ours[1].metrics is not None and ours[1].metrics.running == 3
    assert ours[3].error is not None and ours[3].error.startswith("bad metrics: line 3")
    assert all(r.latency > 0 for r in ours)


async def test_the_child_keeps_one_connection_per_pod_across_rounds(
    scraper: ProcessScraper,
) -> None:
    async with peer_recording_server() as (address, peers):
        rounds = [await scraper.scrape([address]) for _ in range(4)]
    assert all(all_ok(results) for results in rounds)
    assert len(peers) == 1


async def test_a_hanging_pod_fails_alone(servers: list[MetricsServer]) -> None:
    # The child ends the hanging request at the request timeout and answers the
    # round (a round the child left unanswered would fail both pods, with the
    # child's reason).
    scraper = ProcessScraper(ScrapeConfig(interval=2.0, timeout=2.0, stale_after=20.0))
    try:
        healthy = await serve(servers)
        hanging = await serve(servers)
        await scraper.scrape([healthy.address])  # the child is up
        hanging.hang()
        results = await scraper.scrape([healthy.address, hanging.address])
    finally:
        await scraper.close()
    assert results[0].ok, results[0].error
    assert results[1].error == "no answer within 2000 ms"


async def test_a_pod_that_went_away_fails_to_connect(
    servers: list[MetricsServer], scraper: ProcessScraper
) -> None:
    pod = await serve(servers)
    (first,) = await scraper.scrape([pod.address])
    assert first.ok, first.error
    await pod.stop()
    (second,) = await scraper.scrape([pod.address])
    assert second.error is not None and second.error.startswith("cannot connect")


async def test_a_killed_child_fails_its_round_and_is_logged_and_replaced(
    servers: list[MetricsServer], scraper: ProcessScraper, caplog: pytest.LogCaptureFixture
) -> None:
    pod = await serve(servers)
    assert all_ok(await scraper.scrape([pod.address]))
    killed = scraper.pid
    assert killed is not None
    os.kill(killed, signal.SIGSTOP)  # so that it dies with the round's request in hand
    round_ = asyncio.create_task(scraper.scrape([pod.address]))
    await asyncio.sleep(0)  # the round's first step sends its request to the ready child
    os.kill(killed, signal.SIGKILL)
    (failed,) = await round_
    assert failed.error == "the scraper process exited during the round"
    rounds = await rounds_until(scraper, [pod.address], all_ok)
    # Until the new child answered, the pod failed (and would go stale) with the reason.
    assert {r.error for results in rounds[:-1] for r in results} <= {
        "the scraper process is restarting"
    }
    assert scraper.pid not in (None, killed)
    assert scraper.restarts == 1
    assert f"scraper process {killed} exited (killed by signal 9)" in caplog.text
    assert process_gone(killed)


async def test_a_stuck_child_is_killed_after_three_silent_rounds_and_replaced(
    servers: list[MetricsServer],
    short_scraper: ProcessScraper,
    caplog: pytest.LogCaptureFixture,
) -> None:
    scraper = short_scraper
    pod = await serve(servers)
    assert all_ok(await scraper.scrape([pod.address]))
    stuck = scraper.pid
    assert stuck is not None
    os.kill(stuck, signal.SIGSTOP)
    try:
        silent = [await scraper.scrape([pod.address]) for _ in range(3)]
    finally:
        os.kill(stuck, signal.SIGCONT)  # harmless if it was killed already
    assert [results[0].error for results in silent] == [
        "the scraper process did not answer within 4000 ms"
    ] * 3
    assert f"scraper process {stuck} did not answer 3 rounds in a row; killing it" in caplog.text
    await rounds_until(scraper, [pod.address], all_ok)
    assert scraper.pid not in (None, stuck)
    assert process_gone(stuck)


async def test_a_late_answer_is_not_taken_for_the_next_round(
    servers: list[MetricsServer], short_scraper: ProcessScraper
) -> None:
    scraper = short_scraper
    first, second = await serve(servers), await serve(servers)
    assert all_ok(await scraper.scrape([first.address]))
    child = scraper.pid
    assert child is not None
    os.kill(child, signal.SIGSTOP)
    try:
        (late,) = await scraper.scrape([first.address])
    finally:
        os.kill(child, signal.SIGCONT)
    assert late.error == "the scraper process did not answer within 4000 ms"
    (answer,) = await scraper.scrape([second.address])
    assert answer.address == second.address
    assert answer.ok, answer.error
    assert scraper.pid == child


async def test_rounds_the_child_skipped_still_change_the_pods_it_scrapes(
    servers: list[MetricsServer], short_scraper: ProcessScraper
) -> None:
    # The addresses go to the child only when they change. Two rounds wait
    # while the child is stopped: the first carries the new pod set, the
    # second none (the same set), and the child, once woken, skips the first
    # but must scrape the set it carried.
    scraper = short_scraper
    old = await serve(servers, vllm_text(waiting=1))
    new = await serve(servers, vllm_text(waiting=2))
    assert all_ok(await scraper.scrape([old.address]))
    child = scraper.pid
    assert child is not None
    os.kill(child, signal.SIGSTOP)
    try:
        for _ in range(2):
            (late,) = await scraper.scrape([new.address])
            assert late.error == "the scraper process did not answer within 4000 ms"
    finally:
        os.kill(child, signal.SIGCONT)
    (answer,) = await scraper.scrape([new.address])
    assert answer.metrics is not None, answer.error
    assert (answer.address, answer.metrics.waiting_queue) == (new.address, 2)
    both = await scraper.scrape([old.address, new.address])
    assert [r.metrics.waiting_queue if r.metrics else r.error for r in both] == [1, 2]
    assert scraper.pid == child


async def test_retain_closes_the_connections_of_pods_that_left(scraper: ProcessScraper) -> None:
    closed = asyncio.Event()
    handler = answering_until_closed(closed)

    async with RawServer(handler) as server:
        assert all_ok(await scraper.scrape([server.address]))
        assert not closed.is_set()
        scraper.retain([])
        await asyncio.wait_for(closed.wait(), 30)


async def test_the_childs_log_records_are_logged_by_the_serving_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)  # the child sends records at the level in force at its start

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Answers a family filter with nothing (old prometheus_client in multiprocess mode).
        while True:
            try:
                request = await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            body = b"" if b"?" in request.split(b"\r\n")[0] else BODY
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    scraper = ProcessScraper(CONFIG)
    try:
        async with RawServer(handler) as server:
            assert all_ok(await scraper.scrape([server.address]))
    finally:
        await scraper.close()
    records = [r for r in caplog.records if r.name == "policyd.pool.scraper"]
    assert len(records) == 1
    assert records[0].getMessage().startswith(f"scraper process: pod {server.address}: ")
    assert records[0].getMessage().endswith("asking for the whole page")


async def test_a_pool_by_default_scrapes_in_a_child_and_stops_it(
    servers: list[MetricsServer],
) -> None:
    pod = await serve(servers, vllm_text(running=4))

    class OnePod:
        async def updates(self) -> AsyncIterator[tuple[PodIdentity, ...]]:
            yield (PodIdentity.of("a", pod.address),)
            await asyncio.Event().wait()

    pool = Pool(OnePod(), ScrapeConfig(interval=2.0))  # the default but for the pace
    await pool.start()
    try:
        assert await pool.wait_ready(timeout=30)
        snapshot: PoolSnapshot = pool.snapshot()
        assert [p.running for p in snapshot.candidates] == [4]
        scraper = pool._scraper
        assert isinstance(scraper, ProcessScraper)
        child = scraper.pid
        assert child is not None and child != os.getpid()
    finally:
        await pool.stop()
    assert process_gone(child)
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("pool-")]


async def test_the_child_exits_when_the_serving_process_dies(
    servers: list[MetricsServer], tmp_path: Path
) -> None:
    pod = await serve(servers)
    script = tmp_path / "serving.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio
            from policyd.pool.scrape_process import ProcessScraper, answer_timeout
            from policyd.pool.scraper import ScrapeConfig

            async def main():
                scraper = ProcessScraper(ScrapeConfig(interval=5.0))
                (result,) = await scraper.scrape([{pod.address!r}])
                print(scraper.pid if result.ok else result.error, flush=True)
                await asyncio.sleep(60)

            asyncio.run(main())
            """
        )
    )
    serving = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdout=subprocess.PIPE
    )
    try:
        assert serving.stdout is not None
        line = await asyncio.wait_for(serving.stdout.readline(), 30)
        child = int(line)
    finally:
        serving.kill()
        await serving.wait()
    async with asyncio.timeout(30):
        while not process_gone(child):
            await asyncio.sleep(0.02)
