"""A small HTTP/1.1 client made for one job: GET ``/metrics`` from many pods, often.

Why not aiohttp, nor asyncio at all: an aiohttp ``ClientSession`` GET over a
kept-alive loopback connection costs several times the CPU the kernel spends
on the socket calls, and even a bare asyncio protocol pays more per scrape in
transports, handles and callbacks than those calls themselves
(``benchmarks/scrape.py``, ``benchmarks/RESULTS.md``). Here a round is one loop
on the calling thread: it sends every pod's request, then waits on one
selector and reads whatever is ready, framing each response as its bytes
arrive and handing the finished body, still where it was read, to a
callback. No task, future, timer or callback object is made per pod, and
the sockets stay registered with the selector from round to round.

A response's first read goes to one buffer that all endpoints share, and a
whole page usually arrives in that one read. That buffer stays in the CPU's
caches from one pod to the next, where a hundred buffers of their own would
be written cold every round.
Only a response that needs more reads is copied to its endpoint's own buffer.

What it speaks: GET over plain TCP, HTTP/1.0 and 1.1 responses framed by
Content-Length, chunked transfer coding, or the server closing; keep-alive
unless the server says otherwise; no redirects and no compression (it asks for
``identity``). A kept-alive connection the server closed while idle is retried
once on a fresh one, as browsers and urllib3 do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import selectors
import socket
import time
from collections.abc import Callable, Iterable
from typing import Final, NamedTuple

from policyd.pool.discovery import join_address

_MAX_HEAD: Final = 64 * 1024
_SHARED_BUFFER: Final = 256 * 1024  # the first read of each response, for every endpoint
_MIN_READ: Final = 16 * 1024  # free space offered to each later socket read
_KEPT_BUFFER: Final = 1024 * 1024  # a buffer grown past this is dropped after its response
_READ: Final = selectors.EVENT_READ
_WRITE: Final = selectors.EVENT_WRITE
_STATUS_LINE: Final = re.compile(rb"http/1\.(.) (\d\d\d)", re.IGNORECASE)
# The header fields that frame a response, and their values (trailing blanks included).
_FRAMING_HEADER: Final = re.compile(
    rb"\r\n(content-length|transfer-encoding|connection):[ \t]*([^\r\n]*)", re.IGNORECASE
)
_CLOSED_EARLY: Final = "connection closed before the response was complete"


class Body(NamedTuple):
    """A response body, ``data[start:end]`` (a named tuple: one per scrape, cheap to make).

    ``data`` is often a receive buffer itself (no copy is made): the
    client's shared one, which holds still until the client's next socket
    read, or the endpoint's own, until its next request. ``bytes(body)``
    makes a copy to keep.
    """

    data: bytes | bytearray
    start: int
    end: int

    def __bytes__(self) -> bytes:
        with memoryview(self.data) as view:
            return view[self.start : self.end].tobytes()


class MetricsClient:
    """The selector every endpoint of one scraper shares, and the rounds run on it.

    Used by one thread at a time, except ``wake``, which any thread may call
    to have a running ``fetch`` call its ``on_wake`` (the next ``fetch`` does
    when none runs).
    """

    def __init__(self, max_body_bytes: int) -> None:
        self._max_body = max_body_bytes
        self._selector = selectors.DefaultSelector()
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_in.setblocking(False)
        self._wake_out.setblocking(False)
        self._selector.register(self._wake_in, _READ, None)
        self._shared = bytearray(_SHARED_BUFFER)

    def endpoint(self, key: str, host: str, port: int, target: str) -> MetricsEndpoint:
        """A new endpoint, connected at its first request; ``key`` is the caller's name for it."""
        return MetricsEndpoint(
            key,
            host,
            port,
            target,
            max_body_bytes=self._max_body,
            selector=self._selector,
            shared=self._shared,
        )

    def fetch(
        self,
        endpoints: Iterable[MetricsEndpoint],
        timeout: float,
        on_done: Callable[[MetricsEndpoint], bool],
        on_wake: Callable[[], None],
    ) -> None:
        """One request on every endpoint; returns once all finished or ``timeout`` passed.

        ``on_done(endpoint)`` is called once per request, when its ``body`` or
        ``error`` is set, while the body is still in the connection's buffer;
        it returns True to have the endpoint asked again in this round (after
        changing its target). Requests still running at the timeout are
        abandoned with ``no answer within N ms``.
        """
        select = self._selector.select
        waiting: set[MetricsEndpoint] = set()

        def settle(endpoint: MetricsEndpoint) -> None:
            """The endpoint's request finished: report it (and ask again if told to)."""
            while on_done(endpoint):
                endpoint.start(started)
                if not endpoint.finished:
                    return
            waiting.discard(endpoint)

        def woken() -> None:
            self._drain_wake()
            on_wake()
            for endpoint in [e for e in waiting if e.finished]:
                settle(endpoint)

        # Idle connections the server closed, or wrote to unasked, since the
        # last round are retired before a request is sent on them.
        for key, mask in select(0):
            if key.data is None:
                woken()
            else:
                key.data.handle(mask)
        started = time.monotonic()
        deadline = started + timeout
        for endpoint in endpoints:
            waiting.add(endpoint)
            endpoint.start(started)
            if endpoint.finished:
                settle(endpoint)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                reason = f"no answer within {timeout * 1000:.0f} ms"
                for endpoint in waiting:
                    endpoint.abandon(reason)
                    on_done(endpoint)
                return
            for key, mask in select(left):
                ready: MetricsEndpoint | None = key.data  # None: the wake-up socket
                if ready is None:
                    woken()
                    continue
                ready.handle(mask)
                if ready.finished and ready in waiting:
                    settle(ready)

    def wake(self) -> None:
        """Have the running (or next) ``fetch`` call its ``on_wake``; safe from any thread."""
        with contextlib.suppress(BlockingIOError):  # full of wake-ups already
            self._wake_out.send(b"\0")

    def close(self) -> None:
        """Close the selector (the endpoints must be closed first)."""
        self._selector.close()
        self._wake_in.close()
        self._wake_out.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_in.recv(4096):
                pass
        except BlockingIOError:
            pass


class MetricsEndpoint:
    """One pod's metrics URL over one kept-alive connection, one request at a time.

    ``start(now)`` sends a GET (connecting first when there is no idle
    connection); ``handle(mask)`` takes the socket's readiness from the
    selector. The request is over when ``finished``: ``body`` or ``error`` is
    set, ``latency`` is the seconds since ``now``.
    """

    __slots__ = (
        "_body_start",
        "_buffer",
        "_chunk_at",
        "_chunked",
        "_chunked_size",
        "_chunks",
        "_connecting",
        "_expecting",
        "_family",
        "_filled",
        "_keep_alive",
        "_length",
        "_max_body",
        "_own",
        "_own_view",
        "_request",
        "_retried",
        "_reused",
        "_selector",
        "_shared",
        "_shared_view",
        "_sock",
        "_started",
        "_target",
        "_view",
        "_wanted",
        "body",
        "error",
        "host",
        "key",
        "latency",
        "port",
    )

    def __init__(
        self,
        key: str,
        host: str,
        port: int,
        target: str,
        *,
        max_body_bytes: int,
        selector: selectors.BaseSelector,
        shared: bytearray,
    ) -> None:
        self.key = key
        self.host = host
        self.port = port
        self._family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._request = b""
        self.target = target
        self._max_body = max_body_bytes
        self._selector = selector
        self._sock: socket.socket | None = None
        self._connecting = False
        self._expecting = False  # a request was sent and its response is being read
        self._reused = False
        self._retried = False
        self._started = 0.0
        self._shared = shared
        self._shared_view = memoryview(shared)
        self._own = bytearray()  # for responses that take more than one read
        self._own_view = memoryview(self._own)
        self._buffer = shared  # the one being read into, and its view
        self._view = self._shared_view
        self._filled = 0
        self._wanted = 0  # buffer size the response being read needs
        # Framing of the response being read.
        self._body_start = -1  # -1 until the header block is complete
        self._length = -1  # Content-Length, -1 when absent
        self._chunked = False
        self._keep_alive = True
        self._chunk_at = 0
        self._chunks: list[bytes] = []
        self._chunked_size = 0
        self.body: Body | None = None
        self.error: str | None = None
        self.latency = 0.0

    @property
    def target(self) -> str:
        """The path and query requested."""
        return self._target

    @target.setter
    def target(self, target: str) -> None:
        self._target = target
        self._request = (
            f"GET {target} HTTP/1.1\r\nHost: {join_address(self.host, self.port)}\r\n"
            "User-Agent: policyd\r\n"
            "Accept: text/plain\r\nAccept-Encoding: identity\r\n\r\n"
        ).encode("ascii")

    @property
    def finished(self) -> bool:
        return self.body is not None or self.error is not None

    def start(self, now: float) -> None:
        """Send a GET, on the kept-alive connection if there is one; ``latency``
        will count from ``now`` (``time.monotonic()``, the round's start)."""
        self.body = None
        self.error = None
        self._started = now
        self._retried = False
        if self._sock is not None and not self._connecting:
            self._send(reused=True)
        else:
            self._connect()

    def handle(self, mask: int) -> None:
        """The selector reports the socket ready."""
        if self._connecting:
            self._connected()
        elif self._expecting:
            self._read()
        else:
            # An idle connection became readable: the server closed it or sent
            # bytes nobody asked for (the stream is out of step). Never reuse it.
            self._drop()

    def abandon(self, reason: str) -> None:
        """Give up on the request in flight; its connection is dropped, since a
        late answer on it would be taken for the next request's."""
        if self.finished:
            return
        self._drop()
        self._finish(None, reason)

    def close(self) -> None:
        self._drop()

    def _connect(self) -> None:
        self._drop()
        try:
            sock = socket.socket(self._family, socket.SOCK_STREAM)
        except OSError as error:
            self._finish(None, f"cannot connect: {error.strerror or error}")
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        status = sock.connect_ex((self.host, self.port))
        if status not in (0, errno.EINPROGRESS):
            sock.close()
            self._finish(None, f"cannot connect: {os.strerror(status)}")
            return
        self._sock = sock
        if status == 0:
            self._selector.register(sock, _READ, self)
            self._send(reused=False)
        else:
            self._connecting = True
            self._selector.register(sock, _WRITE, self)

    def _connected(self) -> None:
        sock = self._sock
        assert sock is not None
        status = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if status:
            self._drop()
            self._finish(None, f"cannot connect: {os.strerror(status)}")
            return
        self._connecting = False
        self._selector.modify(sock, _READ, self)
        self._send(reused=False)

    def _send(self, *, reused: bool) -> None:
        sock = self._sock
        assert sock is not None
        self._expecting = True
        self._reused = reused
        self._filled = 0
        self._wanted = 0
        self._body_start = -1
        self._length = -1
        self._chunked = False
        self._keep_alive = True
        self._chunks = []
        self._chunked_size = 0
        request = self._request
        try:
            sent = sock.send(request)
        except OSError as error:
            self._lost(f"{_CLOSED_EARLY}: {error}")
            return
        if sent != len(request):  # an empty send buffer takes a few hundred bytes
            self._lost(f"{_CLOSED_EARLY}: the request could not be sent whole")

    def _read(self) -> None:
        sock = self._sock
        assert sock is not None
        filled = self._filled
        if filled == 0:
            self._buffer, self._view = self._shared, self._shared_view
        else:
            size = len(self._buffer)
            if size - filled < _MIN_READ or size < self._wanted:
                self._grow(max(self._wanted, filled + _MIN_READ, 2 * size))
        try:
            count = sock.recv_into(self._view[filled:])
        except BlockingIOError:
            return
        except OSError as error:
            self._lost(f"{_CLOSED_EARLY}: {error}")
            return
        if count == 0:
            if self._body_start >= 0 and not self._chunked and self._length < 0:
                self._keep_alive = False  # the body ends when the server closes
                self._complete(Body(self._buffer, self._body_start, filled))
            else:
                self._lost(_CLOSED_EARLY)
            return
        self._filled = filled + count
        try:
            body = self._frame()
        except ValueError as error:
            self._drop()
            self._finish(None, str(error))
            return
        if body is not None:
            self._complete(body)
        elif self._buffer is self._shared:
            self._keep_own()

    def _keep_own(self) -> None:
        """Move the response read so far out of the shared buffer, which the
        next read of any endpoint overwrites, into this endpoint's own."""
        filled = self._filled
        if len(self._own) < filled + _MIN_READ:
            self._own_view.release()
            self._own = bytearray(max(filled + _MIN_READ, self._wanted))
            self._own_view = memoryview(self._own)
        self._own_view[:filled] = self._shared_view[:filled]
        self._buffer, self._view = self._own, self._own_view

    def _grow(self, size: int) -> None:
        """Make the endpoint's own buffer, being read into, ``size`` bytes long."""
        self._own_view.release()
        self._own.extend(bytes(size - len(self._own)))
        self._own_view = memoryview(self._own)
        self._buffer, self._view = self._own, self._own_view

    def _frame(self) -> Body | None:
        """The body once the response is complete; ``ValueError`` if it is broken."""
        if self._body_start < 0:
            head_end = self._buffer.find(b"\r\n\r\n", 0, self._filled)
            if head_end < 0:
                if self._filled > _MAX_HEAD:
                    raise ValueError("response headers exceed 64 KiB")
                return None
            status = self._read_head(head_end)
            if status != 200:
                raise ValueError(f"HTTP status {status}")
        if self._chunked:
            return self._read_chunks()
        if self._length >= 0:
            return self._read_sized()
        if self._filled - self._body_start > self._max_body:
            raise ValueError(f"response body exceeds {self._max_body} bytes")
        return None  # the body ends when the server closes

    def _read_head(self, head_end: int) -> int:
        # Two pattern passes over the head where it lies, no copy of it and
        # no loop over its lines: this runs for every scrape.
        buffer = self._buffer
        status = _STATUS_LINE.match(buffer, 0, head_end)
        if status is None:
            line_end = buffer.find(b"\r\n", 0, head_end)
            status_line = buffer[: min(head_end if line_end < 0 else line_end, 60)]
            raise ValueError(f"not an HTTP/1.x response: {status_line.decode('latin-1')!r}")
        length = transfer_coding = connection = None
        for field, value in _FRAMING_HEADER.findall(buffer, 0, head_end):
            name = field.lower()  # the first of each counts
            if name == b"content-length":
                length = value.strip() if length is None else length
            elif name == b"transfer-encoding":
                transfer_coding = value.lower() if transfer_coding is None else transfer_coding
            elif connection is None:
                connection = value.lower()
        if length is not None:
            if not length.isdigit():
                raise ValueError(f"bad Content-Length {length.decode('latin-1')!r}")
            self._length = int(length)
        self._chunked = transfer_coding is not None and b"chunked" in transfer_coding
        keep_alive = status[1] == b"1"  # HTTP/1.1 keeps alive unless told not to
        if connection is not None:
            if b"close" in connection:
                keep_alive = False
            elif b"keep-alive" in connection:
                keep_alive = True
        if self._length > self._max_body:
            raise ValueError(f"response body of {self._length} bytes exceeds {self._max_body}")
        if not self._chunked and self._length < 0:
            keep_alive = False  # framed by the close
        self._keep_alive = keep_alive
        self._body_start = head_end + 4
        self._chunk_at = self._body_start
        if self._length >= 0:  # room for the whole body at once, not doubling towards it
            self._wanted = self._body_start + self._length
        return int(status[2])

    def _read_sized(self) -> Body | None:
        end = self._body_start + self._length
        if self._filled < end:
            return None
        if self._filled > end:
            self._keep_alive = False  # more bytes than the response: out of step
        return Body(self._buffer, self._body_start, end)

    def _read_chunks(self) -> Body | None:
        buffer, filled = self._buffer, self._filled
        while True:
            line_end = buffer.find(b"\r\n", self._chunk_at, filled)
            if line_end < 0:
                if filled - self._chunk_at > _MAX_HEAD:
                    raise ValueError("chunk size line too long")
                return None
            size_text = self._slice(self._chunk_at, line_end).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ValueError(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                if buffer[line_end + 2 : line_end + 4] == b"\r\n" and filled >= line_end + 4:
                    end = line_end + 4
                else:  # trailer fields, then an empty line
                    trailers_end = buffer.find(b"\r\n\r\n", line_end, filled)
                    if trailers_end < 0:
                        return None
                    end = trailers_end + 4
                if filled > end:
                    self._keep_alive = False
                joined = b"".join(self._chunks)
                return Body(joined, 0, len(joined))
            data_end = line_end + 2 + size
            if filled < data_end + 2:
                return None
            if buffer[data_end : data_end + 2] != b"\r\n":
                raise ValueError("chunk data is not followed by CRLF")
            self._chunked_size += size
            if self._chunked_size > self._max_body:
                raise ValueError(f"response body exceeds {self._max_body} bytes")
            self._chunks.append(self._slice(line_end + 2, data_end))
            self._chunk_at = data_end + 2

    def _slice(self, start: int, end: int) -> bytes:
        """A copy of part of the buffer (one copy: no bytearray in between)."""
        return self._view[start:end].tobytes()

    def _complete(self, body: Body) -> None:
        self._expecting = False
        self._chunks = []
        if len(self._own) > _KEPT_BUFFER:  # one huge page: do not hold on to its memory
            self._own_view.release()
            self._own = bytearray()
            self._own_view = memoryview(self._own)
        if not self._keep_alive:
            self._drop()
        self._finish(body, None)

    def _lost(self, reason: str) -> None:
        """The connection broke with a request in flight. One that was kept
        alive and broke before a byte came back was closed while idle: the
        request is sent once more, on a fresh connection."""
        retry = self._reused and self._filled == 0 and not self._retried
        self._drop()
        if retry:
            self._retried = True
            self._connect()
        else:
            self._finish(None, reason)

    def _drop(self) -> None:
        sock = self._sock
        if sock is None:
            return
        self._sock = None
        self._connecting = False
        self._expecting = False
        self._selector.unregister(sock)
        sock.close()

    def _finish(self, body: Body | None, error: str | None) -> None:
        self.body = body
        self.error = error
        self.latency = time.monotonic() - self._started
