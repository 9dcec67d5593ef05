"""The ext_proc ``Process`` stream: one gRPC stream per HTTP request.

The servicer only moves messages: each one goes to the request's
``Exchange`` (``policyd.extproc.exchange``), which answers it, and the answer
goes back to gRPC. The exchange owns the request's end; the servicer tells it
when a reply went out and when the stream is gone, and stops reading once the
exchange says it is over.

policyd ends the stream itself, with status OK, when the exchange ends, and
reads nothing after that. Envoy (without the experimental
``ext_proc_graceful_grpc_close``, which crashed Envoy 1.40) resets a stream
as soon as it has the reply to its last message, and grpcio's asyncio server
leaks a batch that a reset makes fail: a pending read, or the status sent
after the reset came (grpc/grpc#43360). So the response's last message gets
no reply at all: policyd's status OK is the answer (Envoy takes a server's OK
close as "processing complete" and passes the message on unchanged, which is
what the reply would have said), and Envoy's reset can only follow it. An
error policyd answers (an ImmediateResponse) must be sent, and its status
races Envoy's reset. A reset that still reaches policyd after the end is a
normal end: the exchange counts it (``stream_error("reset", "after_end")``),
never logged above debug.

In FULL_DUPLEX_STREAMED response mode Envoy forwards only the body the
server sends back, so the last chunk (or the trailers) must be answered:
policyd sends that reply and ends the stream at once, reading nothing more,
which leaves the reset only a status to race, as for an error answer. A
message may also get several replies (the routing, then the request body) or
none yet (a request body chunk while the body is gathered).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import AsyncIterator, Callable
from typing import Any, Final, cast

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from policyd.extproc import epp, replies
from policyd.extproc.budget import BodyBudget, ByteBudget
from policyd.extproc.exchange import Answer, Exchange
from policyd.extproc.exchange_state import State
from policyd.extproc.holding import HeldReply, Holding
from policyd.extproc.interfaces import RouterSource, SnapshotSource, Telemetry
from policyd.extproc.objectives import ObjectsSource, no_objects
from policyd.extproc.serving import ResponseWatch, ServingSettings
from policyd.extproc.settlement import Settlement
from policyd.flow.control import AdmissionSource
from policyd.prefix.probe import PrefixLocator

log = logging.getLogger("policyd.extproc")

_EOF: Final = grpc.aio.EOF


class ExternalProcessor:
    """The gRPC servicer; reads the current router and pool snapshot per request.

    Its replies are wire bytes (``replies``): ``server`` registers ``Process``
    with no response serializer.
    """

    def __init__(
        self,
        routers: RouterSource,
        snapshots: SnapshotSource,
        telemetry: Telemetry,
        settings: ServingSettings,
        prefix: PrefixLocator | None = None,
        *,
        objects: ObjectsSource = no_objects,
    ) -> None:
        self.routers = routers
        self.snapshots = snapshots
        self.telemetry = telemetry
        self.settings = settings
        self.route_replies = replies.RouteReplies(prefill_header=settings.prefill_header)
        self.settlement = Settlement()
        self.rng = random.Random()  # ties among pods for body-less requests
        self.body_budget = BodyBudget(settings.max_buffered_body_bytes, settings.body_wait_seconds)
        self.usage_budget = ByteBudget(settings.max_usage_bytes)
        self.response_watch = ResponseWatch(settings.in_flight_expiry_seconds)
        self.subsets = epp.Subsets()
        self.prefix = prefix
        self.objects = objects
        # Flow control's metrics, where the telemetry has them (test doubles may not).
        # The router's ``admission`` is asked only for a request whose policy has a
        # ``flow`` section, which only a ``policyd.policy.Router`` serves.
        admissions = cast(Callable[[], AdmissionSource], routers)
        self.holding = Holding(admissions, snapshots, getattr(telemetry, "flow", None))

    async def Process(  # noqa: N802 (the gRPC method name)
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[bytes]:
        exchange = Exchange(self, context.invocation_metadata)
        # Messages are read with ``context.read()``, not by iterating
        # ``request_iterator``: grpc's iterator is a generator that keeps the last
        # message it gave in its suspended frame, and when policyd ends a stream
        # (after an error answer, say) that generator is left in a reference cycle
        # until the cyclic garbage collector gets to it: a request body of
        # megabytes per such stream, 400-600 MB under a flood of them where
        # reading with ``context.read()`` peaks at 150-180 MB (benchmarks/memory.py).
        # Test doubles without ``read`` feed the iterator.
        read = getattr(context, "read", None)
        if read is None:
            read = functools.partial(anext, aiter(request_iterator), _EOF)
        reset = False
        try:
            while True:
                message = await read()
                if message is _EOF:
                    return
                reply = exchange.handle(message)
                # Not kept while the stream waits (a request body can be megabytes,
                # and the next message may be a whole generation away).
                del message
                if isinstance(reply, HeldReply):  # flow control holds the request
                    yield reply.extension  # Envoy: wait this long for the answer
                    reply = cast(Answer, await reply.result)  # cancelled: the client left
                if reply is None:  # the response's last message: the status OK answers it
                    return
                if isinstance(reply, bytes):
                    yield reply  # resumes once gRPC has taken the reply
                elif reply:
                    for part in reply:  # FULL_DUPLEX_STREAMED: in the order Envoy requires
                        yield part
                else:
                    continue  # a request body chunk gathered: nothing to answer yet
                exchange.reply_sent()
                if exchange.state is State.ENDED:  # policyd answered the request itself
                    return  # status OK now: no read left for Envoy's reset to cancel
        except asyncio.CancelledError:
            reset = True
            raise
        finally:
            exchange.close(reset=reset)
