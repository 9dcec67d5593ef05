"""The trace context a decision span is parented on: ``TraceCarrier``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

TRACE_KEYS: Final = ("traceparent", "tracestate")


class TraceCarrier(Mapping[str, str]):
    """The trace context a decision span is parented on, worked out when first read.

    Envoy's own (``traceparent`` / ``tracestate`` in the ext_proc stream's
    gRPC metadata) when it sent one, else the client's HTTP headers. grpc
    builds the stream's metadata anew on every ``invocation_metadata()``
    call (a few microseconds), and only tracing and the decision log read
    the carrier: without them it is never read.
    """

    __slots__ = ("_headers", "_items", "_metadata")

    def __init__(self, metadata: Callable[[], Any], headers: Mapping[str, str]) -> None:
        self._metadata = metadata
        self._headers = headers
        self._items: dict[str, str] | None = None

    def _read(self) -> dict[str, str]:
        items = self._items
        if items is None:
            items = {}
            for key, value in self._metadata() or ():
                text = value if isinstance(value, str) else value.decode()
                if key in TRACE_KEYS and text:
                    items[key] = text
            if not items and "traceparent" in self._headers:
                items = {k: v for k in TRACE_KEYS if (v := self._headers.get(k))}
            self._items = items
        return items

    def __getitem__(self, key: str) -> str:
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())
