"""A small HTTP/1.1 client made for one job: GET ``/metrics`` from many pods, often.

Why not aiohttp: on these machines an aiohttp ``ClientSession`` GET over a
kept-alive loopback connection costs about 190 us of CPU, so 100 pods at 10 Hz
would take ~0.2 of a core before a byte is parsed (``benchmarks/scrape.py``
runs both side by side). This client keeps one connection per pod, writes a
request built once, receives into a buffer it keeps, frames the response as
bytes arrive and reports through a callback, so a scrape round costs no
task, future or timer per pod.

What it speaks: GET over plain TCP, HTTP/1.0 and 1.1 responses framed by
Content-Length, chunked transfer coding, or the server closing; keep-alive
unless the server says otherwise; no redirects and no compression (it asks for
``identity``). A kept-alive connection the server closed while idle is retried
once on a fresh one, as browsers and urllib3 do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from policyd.pool.discovery import join_address

_MAX_HEAD: Final = 64 * 1024
_INITIAL_BUFFER: Final = 64 * 1024  # most metrics pages fit; larger ones grow it once
_MIN_READ: Final = 16 * 1024  # free space offered to each socket read
_KEPT_BUFFER: Final = 1024 * 1024  # a buffer grown past this is dropped after its response
_DISCARD: Final = bytearray(4096)  # where bytes nobody asked for are read to


@dataclass(frozen=True, slots=True)
class Body:
    """A response body, ``data[start:end]``.

    ``data`` is often the connection's receive buffer itself (no copy is
    made): it holds still until the endpoint's next ``fetch``. ``bytes(body)``
    makes a copy to keep.
    """

    data: bytes | bytearray
    start: int
    end: int

    def __bytes__(self) -> bytes:
        with memoryview(self.data) as view:
            return view[self.start : self.end].tobytes()


class MetricsEndpoint:
    """One pod's metrics URL over one kept-alive connection, one request at a time.

    ``fetch(on_done)`` starts a GET; ``on_done(endpoint)`` is called exactly
    once, when ``body`` or ``error`` is set (``abandon`` sets an error).
    ``latency`` is the seconds from ``fetch`` to that moment. Must be used on
    one event loop.
    """

    __slots__ = (
        "_connect_task",
        "_connection",
        "_loop",
        "_max_body",
        "_on_done",
        "_request",
        "_retried",
        "_started",
        "_target",
        "body",
        "error",
        "host",
        "latency",
        "port",
    )

    def __init__(self, host: str, port: int, target: str, max_body_bytes: int) -> None:
        self.host = host
        self.port = port
        self._request = b""
        self.target = target
        self._max_body = max_body_bytes
        self._loop = asyncio.get_running_loop()
        self._connection: _Connection | None = None
        self._connect_task: asyncio.Task[None] | None = None
        self._on_done: Callable[[MetricsEndpoint], None] | None = None
        self._started = 0.0
        self._retried = False
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

    def fetch(self, on_done: Callable[[MetricsEndpoint], None]) -> None:
        self.body = None
        self.error = None
        self._on_done = on_done
        self._started = self._loop.time()
        self._retried = False
        connection = self._connection
        if connection is not None and connection.idle:
            connection.send(self._request, reused=True)
        else:
            self._open()

    def abandon(self, reason: str) -> None:
        """Give up on the request in flight; its connection is dropped, since a
        late answer on it would be taken for the next request's."""
        if self._on_done is None:
            return
        self._drop_connection()
        self._finish(None, reason)

    def close(self) -> None:
        self._on_done = None
        self._drop_connection()

    def _open(self) -> None:
        self._drop_connection()
        self._connect_task = self._loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            _, connection = await self._loop.create_connection(
                lambda: _Connection(self, self._max_body), self.host, self.port
            )
        except OSError as error:
            self._connect_task = None
            self._finish(None, f"cannot connect: {error.strerror or error}")
            return
        self._connect_task = None
        self._connection = connection
        connection.send(self._request, reused=False)

    def _drop_connection(self) -> None:
        if self._connect_task is not None:
            self._connect_task.cancel()
            self._connect_task = None
        if self._connection is not None:
            self._connection.abort()
            self._connection = None

    # Called by the connection.

    def _response(self, connection: _Connection, body: Body) -> None:
        if connection is self._connection:
            self._finish(body, None)

    def _failure(self, connection: _Connection, reason: str, *, retry: bool) -> None:
        if connection is not self._connection:
            return
        self._connection = None
        if retry and not self._retried and self._on_done is not None:
            self._retried = True
            self._open()
        else:
            self._finish(None, reason)

    def _detach(self, connection: _Connection) -> None:
        if connection is self._connection:
            self._connection = None

    def _finish(self, body: Body | None, error: str | None) -> None:
        on_done = self._on_done
        if on_done is None:
            return
        self._on_done = None
        self.body = body
        self.error = error
        self.latency = self._loop.time() - self._started
        on_done(self)


class _Connection(asyncio.BufferedProtocol):
    """Frames one response at a time on one TCP connection.

    A buffered protocol: the transport receives straight into this
    connection's buffer, which is kept from one response to the next. A plain
    ``Protocol`` would have asyncio allocate a fresh 256 KiB bytes object per
    read (``sock.recv(262144)``), measured at ~30 us per 40 KB page here
    against ~3 us for ``recv_into`` a reused buffer.
    """

    def __init__(self, endpoint: MetricsEndpoint, max_body: int) -> None:
        self._endpoint = endpoint
        self._max_body = max_body
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray(_INITIAL_BUFFER)
        self._filled = 0
        self._wanted = 0  # buffer size the response being read needs
        self._expecting = False
        self._reused = False
        self._closed = False
        # Framing of the response being read.
        self._body_start = -1  # -1 until the header block is complete
        self._length = -1  # Content-Length, -1 when absent
        self._chunked = False
        self._keep_alive = True
        self._chunk_at = 0
        self._chunks: list[bytes] = []
        self._chunked_size = 0

    @property
    def idle(self) -> bool:
        return not self._expecting and not self._closed and self._transport is not None

    def send(self, request: bytes, *, reused: bool) -> None:
        assert self._transport is not None
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
        self._transport.write(request)

    def abort(self) -> None:
        self._expecting = False
        self._closed = True
        if self._transport is not None:
            self._transport.abort()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self._expecting:
            # Bytes nobody asked for (``buffer_updated`` closes the connection)
            # must not land on the last body, which is still being read.
            return memoryview(_DISCARD)
        # The buffer may only be resized here: while ``buffer_updated`` runs,
        # the transport still holds the view handed out for the read.
        size = len(self._buffer)
        if size - self._filled < _MIN_READ or size < self._wanted:
            wanted = max(self._wanted, self._filled + _MIN_READ, 2 * size)
            self._buffer.extend(bytes(wanted - size))
        return memoryview(self._buffer)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if not self._expecting:
            # Bytes nobody asked for: the stream is out of step, never reuse it.
            self._close()
            return
        try:
            body = self._frame()
        except ValueError as error:
            self._fail(str(error))
            return
        if body is not None:
            self._complete(body)

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

    def eof_received(self) -> bool:
        if self._expecting and self._body_start >= 0 and not self._chunked and self._length < 0:
            self._complete(Body(self._buffer, self._body_start, self._filled))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if not self._expecting:
            self._endpoint._detach(self)
            return
        self._expecting = False
        # A kept-alive connection closed before answering was closed while idle.
        retry = self._reused and self._filled == 0
        reason = "connection closed before the response was complete"
        if exc is not None:
            reason = f"{reason}: {exc}"
        self._endpoint._failure(self, reason, retry=retry)

    def _read_head(self, head_end: int) -> int:
        # Three header lookups in the lower-cased block instead of a loop over
        # its lines: this runs for every scrape.
        head = self._slice(0, head_end).decode("latin-1").lower() + "\r\n"
        status_end = head.find("\r\n")
        version, _, rest = head[:status_end].partition(" ")
        code = rest[:3]
        if not version.startswith("http/1.") or not code.isdigit():
            raise ValueError(f"not an HTTP/1.x response: {head[: min(status_end, 60)]!r}")
        length = _header(head, "\r\ncontent-length:")
        if length is not None:
            if not length.isdigit():
                raise ValueError(f"bad Content-Length {length!r}")
            self._length = int(length)
        self._chunked = "chunked" in (_header(head, "\r\ntransfer-encoding:") or "")
        connection = _header(head, "\r\nconnection:") or ""
        keep_alive = version == "http/1.1"
        if "close" in connection:
            keep_alive = False
        elif "keep-alive" in connection:
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
        return int(code)

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
        with memoryview(self._buffer) as view:
            return view[start:end].tobytes()

    def _complete(self, body: Body) -> None:
        self._expecting = False
        self._filled = 0
        self._chunks = []
        if len(self._buffer) > _KEPT_BUFFER:  # one huge page: do not hold on to its memory
            self._buffer = bytearray(_INITIAL_BUFFER)
        if not self._keep_alive:
            self._close()
        self._endpoint._response(self, body)

    def _fail(self, reason: str) -> None:
        self._expecting = False
        self._close()
        self._endpoint._failure(self, reason, retry=False)

    def _close(self) -> None:
        self._closed = True
        if self._transport is not None:
            self._transport.close()


def _header(head: str, marker: str) -> str | None:
    """The value of the first header ``marker`` starts (``"\\r\\nname:"``) in a lower-cased head."""
    at = head.find(marker)
    if at < 0:
        return None
    start = at + len(marker)
    return head[start : head.find("\r\n", start)].strip()
