"""Scrape rounds run by a child process, so the serving event loop only lands results.

Scraping 100 pods ten times a second costs several hundredths of a core of
Python (socket work, HTTP framing, parsing: ``benchmarks/scrape.py``), and a
round parses its answers back to back, holding the GIL of whatever process
runs it. In the serving process, that is CPU taken from Envoy's streams and
stalls of the serving loop every round. ``ProcessScraper`` has the in-process
``Scraper``'s interface (``scrape`` / ``retain`` / ``close``,
``ScrapeRounds``) but a ``ScrapeLoop`` in a child process
(``policyd.pool.scrape_child``) does the work on the child's only thread,
keeping its kept-alive connections across rounds.
Each round the serving process asks for a round and gets one result per
pod back, in the order of the round's addresses: length-prefixed pickles
over a Unix socket pair, read by an asyncio protocol, so the serving loop
never waits on the child. The addresses go over only when they differ from
the last round's, and the results do not repeat them: the two ends would
otherwise pickle and unpickle a hundred addresses each way every round. The
pods' preset labels (mixed pools, ``pod_presets``) likewise go over only when
they change.
Everything else of the pool (datastore, snapshots, in-flight counters,
staleness, statistics) stays in the serving process.

When the child fails, the pods look exactly as if they had stopped answering:

- a round whose answer is not back within its deadline (``answer_timeout``:
  the stale threshold, at least the request timeout plus one interval)
  fails for every pod with the reason, and they leave the candidates as
  pods that stop answering do;
- a child that exits (crash, OOM kill, ``kill -9``) is logged and started
  again, after 0.25 s doubling to 8 s while children keep dying young;
- a child that answers nothing (not even late) for three rounds in a row
  (stopped, stuck) is killed, and then restarted like one that died.

The child is a fresh interpreter (``python -P -m policyd.pool.scrape_child``)
started with ``subprocess``, not ``multiprocessing``: nothing is forked from a
process running gRPC, the parent's ``__main__`` is not imported again (``python
-m policyd serve`` must not run twice), and a daemonic ``multiprocessing``
process may run a pool too. It runs in its own session, so a terminal's
Ctrl-C reaches only policyd, which then stops it; and it exits by itself when
its socket closes, which also happens when the serving process dies. Its log
records come back over the socket and are logged by the serving process, in
its format.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple

from policyd.pool.exposition import PodMetrics
from policyd.pool.scraper import ScrapeConfig, ScrapeResult

log = logging.getLogger(__name__)

START_TIMEOUT: Final = 10.0  # seconds the first round waits for the first child to start
STOP_TIMEOUT: Final = 2.0  # seconds a closed child has to exit before it is killed
MISSED_ROUNDS_LIMIT: Final = 3  # unanswered rounds in a row before a child counts as stuck
FIRST_BACKOFF: Final = 0.25
MAX_BACKOFF: Final = 8.0
HEALTHY_AFTER: Final = 30.0  # a child that lived this long restarts without backoff

CHILD_MODULE: Final = "policyd.pool.scrape_child"


# The messages, both ways (named tuples: picklable, typed, cheap).


class Setup(NamedTuple):
    """First message to the child: how to scrape, and which log records to send back."""

    config: ScrapeConfig
    log_level: int


class ScrapeRequest(NamedTuple):
    """Scrape ``addresses``, or with ``None`` the addresses of the request before;
    ``presets`` (``pod_presets``) likewise."""

    round: int
    addresses: list[str] | None
    presets: dict[str, str] | None = None


class RetainRequest(NamedTuple):
    addresses: list[str]


class Ready(NamedTuple):
    """The child set up its scraper and takes requests."""

    pid: int


class RoundAnswer(NamedTuple):
    round: int
    results: list[WireResult]  # ``to_wire``, in the order of the round's addresses


# A round's results as they cross the socket: plain tuples. Pickle takes a
# named tuple apart and puts it together again with Python-level calls per
# object; plain tuples it copies in C, and ``tuple.__new__`` makes the named
# tuples again without their Python-level constructors, so a round's results
# cost several times less to pickle in the child and less to unpickle in the
# serving process.
WireResult = tuple[tuple[Any, ...] | None, str | None, float]


def to_wire(results: list[ScrapeResult]) -> list[WireResult]:
    return [
        (None if metrics is None else tuple(metrics), error, latency)
        for _, metrics, error, latency in results
    ]


def from_wire(addresses: Sequence[str], results: list[WireResult]) -> list[ScrapeResult]:
    """The results of a round that scraped ``addresses``, one each, in order."""
    if len(results) != len(addresses):
        raise ValueError(f"{len(results)} scrape results for {len(addresses)} pods")
    new = tuple.__new__
    return [
        new(
            ScrapeResult,
            (address, None if metrics is None else new(PodMetrics, metrics), error, latency),
        )
        for address, (metrics, error, latency) in zip(addresses, results, strict=True)
    ]


class LogLine(NamedTuple):
    level: int
    logger: str
    text: str


Message = Setup | ScrapeRequest | RetainRequest | Ready | RoundAnswer | LogLine

_LENGTH: Final = struct.Struct("!I")


def pack(message: Message) -> bytes:
    """A message as it goes over the socket: a 4-byte length, then the message pickled.

    Only the two ends of one socket pair, both policyd, ever read what the
    other wrote; nothing from outside is unpickled.
    """
    payload = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


def unpack(buffer: bytearray) -> list[Message]:
    """The whole messages at the start of ``buffer``, removed from it."""
    messages: list[Message] = []
    start = 0
    while len(buffer) - start >= _LENGTH.size:
        (size,) = _LENGTH.unpack_from(buffer, start)
        end = start + _LENGTH.size + size
        if len(buffer) < end:
            break
        messages.append(pickle.loads(buffer[start + _LENGTH.size : end]))
        start = end
    del buffer[:start]
    return messages


class Link(asyncio.Protocol):
    """The serving process's end of the child's socket: messages (``pack``) read
    and written without blocking the event loop."""

    def __init__(self, on_message: Callable[[Message], None]) -> None:
        self._on_message = on_message
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def send(self, message: Message) -> None:
        """Queue a message (never blocks; dropped once the connection is gone)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(pack(message))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        for message in unpack(self._buffer):
            self._on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)


class _Child:
    """One scraper child process and the serving process's end of its socket."""

    def __init__(self, process: asyncio.subprocess.Process, link: Link) -> None:
        self.process = process
        self.link = link

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def start(cls, setup: Setup, on_message: Callable[[Message], None]) -> _Child:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-P",  # not the working directory first on sys.path: the same policyd as ours
                "-m",
                CHILD_MODULE,
                str(theirs.fileno()),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # stdout may be the decision log; stderr is shared
                start_new_session=True,
                env=_child_environment(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        link = Link(on_message)
        try:
            await asyncio.get_running_loop().create_unix_connection(lambda: link, sock=ours)
        except BaseException:
            ours.close()
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise
        link.send(setup)
        return cls(process, link)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def stop(self) -> int:
        """Close the socket (the child exits on its own), kill it if it does not;
        its exit status (negative: the signal that ended it)."""
        self.link.close()
        try:
            async with asyncio.timeout(STOP_TIMEOUT):
                return await self.process.wait()
        except TimeoutError:
            log.warning("scraper process %d did not exit when closed; killing it", self.pid)
        except asyncio.CancelledError:
            self.kill()
            raise
        self.kill()
        return await self.process.wait()


def answer_timeout(config: ScrapeConfig) -> float:
    """How long a round waits for the child's answer before failing every pod.

    As long as the last snapshot's metrics may stay in use anyway (the stale
    threshold): a child that waits for a core (on a saturated machine a rare
    round's answer comes many times later than the usual one) then costs no
    more than a busy serving loop would, instead of emptying the candidate
    set. At least the request timeout plus one interval.
    """
    return max(config.stale_threshold, config.request_timeout + config.interval)


def _child_environment() -> dict[str, str]:
    """Our environment, with this policyd's directory first on the child's import path."""
    environment = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    path = environment.get("PYTHONPATH")
    environment["PYTHONPATH"] = here if not path else os.pathsep.join((here, path))
    return environment


class ProcessScraper:
    """Scrape rounds in a child process; the in-process ``Scraper``'s interface.

    Must be made and used on one running event loop, which it never blocks:
    the child is started (and restarted) by a task of its own.
    """

    def __init__(self, config: ScrapeConfig) -> None:
        self._config = config
        self._loop = asyncio.get_running_loop()
        self.answer_timeout = answer_timeout(config)
        self._child: _Child | None = None
        self._ready = asyncio.Event()  # the current child said Ready
        self._ever_ready = False
        self._round = 0
        self._waiting: tuple[int, asyncio.Future[list[WireResult]]] | None = None
        self._sent: list[str] | None = None  # the addresses the current child last got
        self._sent_presets: dict[str, str] | None = None  # and the presets
        self._presets: Mapping[str, str] = {}  # the last given
        self._missed = 0  # rounds in a row without any answer from the current child
        self.restarts = 0  # children started after the first
        self._supervisor = self._loop.create_task(self._supervise(), name="pool-scrape-process")

    @property
    def pid(self) -> int | None:
        """The running child's process id, if one is running."""
        return None if self._child is None else self._child.pid

    async def scrape(
        self, addresses: Sequence[str], presets: Mapping[str, str] | None = None
    ) -> list[ScrapeResult]:
        """Every address's result from the child, or a failure for each by the deadline.

        ``presets`` (``pod_presets``; ``None``: the last ones) go to the child
        only when they differ from what it has.
        """
        if not addresses:
            return []
        started = self._loop.time()
        first = not self._ever_ready
        deadline = started + (START_TIMEOUT if first else self.answer_timeout)
        answer: asyncio.Future[list[WireResult]] | None = None
        try:
            async with asyncio.timeout_at(deadline):
                await self._ready.wait()
                child = self._child
                assert child is not None  # ready is cleared as soon as a child goes
                self._round += 1
                answer = self._loop.create_future()
                self._waiting = (self._round, answer)
                child.link.send(
                    ScrapeRequest(
                        self._round,
                        self._addresses_to_send(addresses),
                        self._presets_to_send(presets),
                    )
                )
                return from_wire(addresses, await answer)
        except TimeoutError:
            if answer is not None and _has_result(answer):
                return from_wire(addresses, answer.result())  # came in the deadline's turn
            if answer is None:
                reason = (
                    f"the scraper process did not start within {START_TIMEOUT:.0f} s"
                    if first
                    else "the scraper process is restarting"
                )
            else:
                waited = self.answer_timeout * 1000
                reason = f"the scraper process did not answer within {waited:.0f} ms"
                self._missed_round()
        except _ChildGoneError:
            reason = "the scraper process exited during the round"
        finally:
            self._waiting = None
        latency = self._loop.time() - started
        return [ScrapeResult(address, None, reason, latency) for address in addresses]

    def _addresses_to_send(self, addresses: Sequence[str]) -> list[str] | None:
        """``addresses``, or ``None`` when the child has them from the last round."""
        if self._sent is not None and self._sent == addresses:
            return None
        self._sent = list(addresses)
        return self._sent

    def _presets_to_send(self, presets: Mapping[str, str] | None) -> dict[str, str] | None:
        """``presets`` (``None``: the last given), or ``None`` when the child has them."""
        if presets is None:
            presets = self._presets
        else:
            self._presets = presets
        if self._sent_presets is None:
            self._sent_presets = {}  # a new child starts with none
        if presets == self._sent_presets:
            return None
        self._sent_presets = dict(presets)
        return self._sent_presets

    def retain(self, addresses: Iterable[str]) -> None:
        """Pass the pod set on (a child started later has no connections to close)."""
        if self._child is not None:
            self._child.link.send(RetainRequest(list(addresses)))

    async def close(self) -> None:
        """Stop the child (closing its socket; killed if it does not exit) and its supervisor."""
        self._supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._supervisor

    def _missed_round(self) -> None:
        self._missed += 1
        child = self._child
        if self._missed >= MISSED_ROUNDS_LIMIT and child is not None:
            log.error(
                "scraper process %d did not answer %d rounds in a row; killing it",
                child.pid,
                self._missed,
            )
            child.kill()  # its socket closes; the supervisor starts another

    def _received(self, message: Message) -> None:
        if isinstance(message, RoundAnswer):
            self._missed = 0  # late or not, the child is alive: killing it would not help
            waiting = self._waiting
            if waiting is not None and waiting[0] == message.round and not waiting[1].done():
                waiting[1].set_result(message.results)
            # else: the answer to a round that already gave up
        elif isinstance(message, LogLine):
            logging.getLogger(message.logger).log(
                message.level, "scraper process: %s", message.text
            )
        elif isinstance(message, Ready):
            log.info("scraper process %d started", message.pid)
            self._ever_ready = True
            self._missed = 0
            self._ready.set()

    async def _supervise(self) -> None:
        """Keep one child running until cancelled (by ``close``), which stops it."""
        backoff = FIRST_BACKOFF
        setup = Setup(self._config, logging.getLogger("policyd").getEffectiveLevel())
        while True:
            started = self._loop.time()
            try:
                child = await _Child.start(setup, self._received)
            except OSError as error:
                gone = f"cannot start the scraper process: {error}"
            else:
                self._child = child
                try:
                    await child.link.lost
                except asyncio.CancelledError:
                    self._forget()
                    await child.stop()
                    raise
                self._forget()
                gone = f"scraper process {child.pid} exited ({_describe(await child.stop())})"
            if self._loop.time() - started >= HEALTHY_AFTER:
                backoff = FIRST_BACKOFF
            log.error("%s; starting another in %.2f s", gone, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)
            self.restarts += 1

    def _forget(self) -> None:
        """The child is gone: no round can be sent to it or answered by it."""
        self._child = None
        self._sent = None  # the next child starts with no addresses
        self._sent_presets = None  # nor presets
        self._ready.clear()
        waiting = self._waiting
        if waiting is not None and not waiting[1].done():
            waiting[1].set_exception(_ChildGoneError())


class _ChildGoneError(Exception):
    """The child's socket closed while a round waited for its answer."""


def _has_result(future: asyncio.Future[list[WireResult]]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _describe(status: int) -> str:
    return f"killed by signal {-status}" if status < 0 else f"exit status {status}"
