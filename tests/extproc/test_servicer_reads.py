"""The servicer reads a stream's messages with ``context.read()``, never by iterating.

grpc's request iterator keeps the last message it gave in a suspended
generator frame; a stream policyd ends itself (an error answer) leaves that
generator, and a request body of megabytes with it, in a reference cycle until
the cyclic garbage collector runs (under a flood of such requests the peak
memory is several times what it is reading with ``read()``:
``benchmarks/memory.py``, ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from extproc_support import PickFirst, RecordingTelemetry, Snapshot, request_body, request_headers

from policyd.extproc.process_stream import ExternalProcessor
from policyd.extproc.serving import ServingSettings
from policyd.pool.pod import Pod


class ReadingContext:
    """A servicer context whose ``read()`` gives the messages, then EOF."""

    def __init__(self, *messages: Any) -> None:
        self.messages = list(messages)
        self.reads = 0

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def read(self) -> Any:
        self.reads += 1
        return self.messages.pop(0) if self.messages else grpc.aio.EOF


async def untouchable() -> AsyncIterator[Any]:
    raise AssertionError("the servicer iterated grpc's request iterator")
    yield  # an async generator


def processor() -> ExternalProcessor:
    pods = (Pod("pod-a", "10.0.0.1:8000"),)
    router = PickFirst()
    return ExternalProcessor(
        lambda: router, lambda: Snapshot(pods), RecordingTelemetry(), ServingSettings()
    )


async def test_messages_are_read_with_context_read() -> None:
    context = ReadingContext(request_headers(), request_body({"model": "m" * 2000, "prompt": "hi"}))
    replies = [reply async for reply in processor().Process(untouchable(), context)]
    assert len(replies) == 2  # continue, then the 400 that ends the stream
    assert b"model_too_long" in replies[1]
    assert context.reads == 2  # no read after policyd's own answer


async def test_a_stream_ended_by_envoy_ends_the_exchange() -> None:
    context = ReadingContext(request_headers())
    replies = [reply async for reply in processor().Process(untouchable(), context)]
    assert len(replies) == 1
    assert context.reads == 2  # the headers, then EOF
