"""The scraper child process: ``python -m policyd.pool.scrape_child FD``.

Started by ``ProcessScraper`` (``policyd.pool.scrape_process``), never by
hand. ``FD`` is its end of a Unix socket pair: the first message sets up a
``ScrapeLoop``, then each ``ScrapeRequest`` is answered with its round's
results and each ``RetainRequest`` closes the connections of pods that left,
in the order they came. A request without addresses scrapes those of the
request before, and one without presets (the pods' preset labels) keeps the
last ones. A request that waited while a round ran is skipped when a newer
one waits behind it (the serving process has already given up on it), but
the addresses and presets it carried still count. Log records go back over the
socket. When the socket closes (the serving process stopped it or died) the
child exits.

One thread and no event loop: the child waits on its socket between rounds
and runs each round on the scrape loop's own selector, which costs a fraction
of what asyncio's machinery would per pod (``policyd.pool.metrics_client``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

from policyd.pool.scrape_process import (
    LogLine,
    Message,
    Ready,
    RetainRequest,
    RoundAnswer,
    ScrapeRequest,
    Setup,
    pack,
    to_wire,
    unpack,
)
from policyd.pool.scraper import ScrapeLoop

log = logging.getLogger(__name__)

_READ_SIZE = 256 * 1024


class _Channel:
    """The child's end of the socket: whole messages in, messages out (blocking)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()

    def send(self, message: Message) -> None:
        self._sock.sendall(pack(message))

    def receive(self) -> list[Message]:
        """Every message that came: waits for one, then takes what else is there
        without waiting. Empty once the socket is closed."""
        messages = unpack(self._buffer)
        while not messages:
            data = self._recv(0)
            if not data:
                return []
            self._buffer += data
            messages = unpack(self._buffer)
        while data := self._recv(socket.MSG_DONTWAIT):
            self._buffer += data
            messages += unpack(self._buffer)
        return messages

    def _recv(self, flags: int) -> bytes:
        """Bytes read; empty at the end of the stream or, without waiting, when none are there."""
        try:
            return self._sock.recv(_READ_SIZE, flags)
        except (BlockingIOError, ConnectionResetError):
            return b""


class _LinkHandler(logging.Handler):
    """Sends log records to the serving process, which logs them in its format."""

    def __init__(self, channel: _Channel) -> None:
        super().__init__()
        self._channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._channel.send(LogLine(record.levelno, record.name, self.format(record)))
        except Exception:  # logging must never raise
            self.handleError(record)


def serve(sock: socket.socket) -> int:
    """Answer the serving process until it closes the socket; the exit status."""
    channel = _Channel(sock)
    messages = channel.receive()
    if not messages:
        return 0
    setup, *messages = messages
    if not isinstance(setup, Setup):
        raise TypeError(f"expected the set-up first, got {type(setup).__name__}")
    root = logging.getLogger()
    root.handlers[:] = [_LinkHandler(channel)]
    root.setLevel(setup.log_level)
    scraper = ScrapeLoop(setup.config)
    addresses: list[str] = []  # the last request's that carried any
    try:
        channel.send(Ready(os.getpid()))
        while True:
            newest = max(
                (i for i, message in enumerate(messages) if isinstance(message, ScrapeRequest)),
                default=-1,
            )
            for i, message in enumerate(messages):
                if isinstance(message, RetainRequest):
                    scraper.retain(message.addresses)
                elif isinstance(message, ScrapeRequest):
                    if message.addresses is not None:
                        addresses = message.addresses
                    if message.presets is not None:
                        scraper.set_presets(message.presets)
                    if i == newest:
                        results = scraper.scrape(addresses)
                        channel.send(RoundAnswer(message.round, to_wire(results)))
            messages = channel.receive()
            if not messages:
                return 0
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the serving process is gone
    except Exception:  # a bug: say what, and exit so that another child is started
        log.exception("scrape loop failed")
        return 1
    finally:
        scraper.close()


def main(arguments: list[str]) -> int:
    # SIGINT is for policyd (a new session keeps a terminal's Ctrl-C away;
    # this keeps a signal sent to the whole group away too): closing the
    # socket is how the child is stopped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    (descriptor,) = arguments
    with socket.socket(fileno=int(descriptor)) as sock:
        sock.setblocking(True)
        return serve(sock)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
