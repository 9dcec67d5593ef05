"""The scraper child process: ``python -m policyd.pool.scrape_child FD``.

Started by ``ProcessScraper`` (``policyd.pool.scrape_process``), never by
hand. ``FD`` is its end of a Unix socket pair: the first message sets up a
``Scraper``, then each ``ScrapeRequest`` is answered with its round's results
and each ``RetainRequest`` closes the connections of pods that left, in the
order they came. A request that waited while a round ran is skipped when a
newer one waits behind it: the serving process has already given up on it.
Log records go back over the socket. When the socket closes (the serving
process stopped it or died) the child exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys

from policyd.pool.scrape_process import (
    Link,
    LogLine,
    Message,
    Ready,
    RetainRequest,
    RoundAnswer,
    ScrapeRequest,
    Setup,
)
from policyd.pool.scraper import Scraper


class _LinkHandler(logging.Handler):
    """Sends log records to the serving process, which logs them in its format."""

    def __init__(self, link: Link) -> None:
        super().__init__()
        self._link = link

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._link.send(LogLine(record.levelno, record.name, self.format(record)))
        except Exception:  # logging must never raise
            self.handleError(record)


async def _serve(sock: socket.socket) -> int:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    link = Link(inbox.put_nowait)
    await loop.create_unix_connection(lambda: link, sock=sock)
    work = asyncio.create_task(_work(link, inbox))
    await asyncio.wait((work, link.lost), return_when=asyncio.FIRST_COMPLETED)
    if work.done():  # a bug: say what, and exit so that another child is started
        logging.getLogger(__name__).error("scrape loop failed", exc_info=work.exception())
        return 1
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return 0


async def _work(link: Link, inbox: asyncio.Queue[Message]) -> None:
    setup = await inbox.get()
    if not isinstance(setup, Setup):
        raise TypeError(f"expected the set-up first, got {type(setup).__name__}")
    root = logging.getLogger()
    root.handlers[:] = [_LinkHandler(link)]
    root.setLevel(setup.log_level)
    scraper = Scraper(setup.config)
    link.send(Ready(os.getpid()))
    try:
        while True:
            messages = [await inbox.get()]
            while not inbox.empty():
                messages.append(inbox.get_nowait())
            newest = max(
                (i for i, message in enumerate(messages) if isinstance(message, ScrapeRequest)),
                default=-1,
            )
            for i, message in enumerate(messages):
                if isinstance(message, RetainRequest):
                    scraper.retain(message.addresses)
                elif isinstance(message, ScrapeRequest) and i == newest:
                    results = await scraper.scrape(message.addresses)
                    link.send(RoundAnswer(message.round, results))
    finally:
        await scraper.close()


def main(arguments: list[str]) -> int:
    # SIGINT is for policyd (a new session keeps a terminal's Ctrl-C away;
    # this keeps a signal sent to the whole group away too): closing the
    # socket is how the child is stopped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    (descriptor,) = arguments
    sock = socket.socket(fileno=int(descriptor))
    return asyncio.run(_serve(sock))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
