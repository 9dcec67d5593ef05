"""One HTTP request's life through policyd, message by message: ``Exchange``.

Envoy opens an ext_proc stream per request and sends its phases in order:
request headers, the request body (one BUFFERED message, or STREAMED chunks
that are accumulated to the end), response headers, response body chunks,
trailers if configured. An ``Exchange`` holds one request's state across
those messages and answers each one (``policyd.extproc.process_stream`` moves the
messages between gRPC and it).

In FULL_DUPLEX_STREAMED body mode (how gateways call an InferencePool's
endpoint picker, ``docs/endpoint-picker.md``) replies are not one per
message: Envoy sends the body chunks without waiting and forwards only what
comes back. The exchange then answers nothing until the request body is in
(its end, or the trailers that follow it), decides, and answers everything
at once, in the order Envoy requires (headers, body, trailers): the
request-headers reply carrying the routing, the body as streamed mutations
(echoed, or rewritten with the target model), the trailers' reply. Each
response chunk is handed back as it comes, read for usage on the way. The
proxy's endpoint subset, when it sends one, narrows the candidates before the
router sees them (``epp``).

Isolation is the rule: whatever one request does (bad JSON, a router that
raises, a telemetry bug) ends as an answer for that request alone, and
``handle`` never raises. The in-flight count of the chosen pod goes up when a
request is routed and down exactly once when its exchange ends, however it
ends. The prefill pod of a request a two-stage policy split counts it too,
down exactly once, when the decode pod answers or the exchange ends. The
request's uncached prompt tokens count in the queued prefill of the pod that
prefills it (``pod.queued_prefill_tokens``, a latency-model input) until its
first body bytes (on a prefill pod: until the decode pod answers), or its end
or expiry if they never come.

The exchange owns its end. Where it is in a request's life is one value,
``State`` (reading, decided, routed, responding, answered, ended,
aborted), and the bookkeeping it defers past the replies (the shadow
policies, then telemetry's record of the decision and of the response) is
queued from one place, ``Exchange._record_later``, on the server's
``Settlement``.

What the exchanges of one server share (their limits, the body and
response budgets, the watch over routed requests still waiting for their
response) is ``serving.py``'s, read here through ``ServingContext``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from policyd.extproc import bodyless, epp, replies
from policyd.extproc.errors import RequestError
from policyd.extproc.exchange_state import OVER, State
from policyd.extproc.holding import HeldReply, HeldRequest
from policyd.extproc.interfaces import NULL_SPAN, RequestSpan, RouterLike
from policyd.extproc.objectives import applied
from policyd.extproc.openai import (
    InferenceBody,
    parse_body,
    request_without_body,
    rewrite_model,
)
from policyd.extproc.serving import ServingContext
from policyd.extproc.trace_carrier import TraceCarrier
from policyd.extproc.usage import UsageReader
from policyd.flow import FlowAnswer, Held
from policyd.latency.models import uncached_prompt
from policyd.policy.decision import Decision, Outcome, ShadowReport
from policyd.policy.request import Request
from policyd.pool.pod import InFlight, Pod
from policyd.telemetry.exchange_end import ExchangeEnd

log = logging.getLogger("policyd.extproc")

_BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
_DUPLEX: Final = _BodyMode.FULL_DUPLEX_STREAMED

RETRY_AFTER_SECONDS: Final = 1  # a 429 for a full body budget: bodies are held for milliseconds

# What ``Exchange.handle`` gives for one message: one reply; several, in order
# (FULL_DUPLEX_STREAMED; none while a body is being gathered); None, the
# response's last message, answered by ending the stream (process_stream.py);
# or a held request's ``HeldReply``, whose result is one of the others.
Answer = bytes | tuple[bytes, ...] | list[bytes] | None
Replies = Answer | HeldReply
NO_REPLY: Final[tuple[bytes, ...]] = ()


class Exchange:
    """One HTTP request's life through policyd, phase by phase.

    The exchange owns its end: it releases the pod and the body budget the
    moment it ends, and it alone defers the bookkeeping to after the reply
    (``_record_later``): the decision's record (shadow policies, metrics, span
    attributes, log entry) is queued on the settlement once the reply carrying
    the decision is out, the response's record (status, usage, the span's end)
    once the exchange has ended and that reply is out, and always in that
    order. Telemetry only records what it is handed, when it is handed it.
    """

    __slots__ = (
        "_body",
        "_body_mode",
        "_candidates",  # those the decision was made over: where a served endpoint is found
        "_decided_at",
        "_decision",
        "_ended_at",
        "_first_body_at",
        "_headers",  # regular request headers: what policies see as request.headers
        "_held",  # bytes taken from the server's body budget
        "_holding",  # while HELD: what dispatching needs (``HeldRequest``)
        "_load",
        "_metadata",
        "_method",
        "_path",
        "_prefill_load",  # a split request's prefill pod's in-flight count
        "_queued",  # until its first token: the load counting its prefill, and how much
        "_response_mode",
        "_router",
        "_server",
        "_span",
        "_status",
        "_subset",  # the proxy's endpoint subset (None: the whole pool)
        "_to_headers",
        "_usage",
        "state",
    )

    def __init__(self, server: ServingContext, metadata: Callable[[], Any]) -> None:
        """``metadata`` gives the ext_proc stream's gRPC metadata (read only for
        the trace context, and only when telemetry asks for it)."""
        self._server = server
        self._metadata = metadata
        self.state = State.READING
        self._headers: dict[str, str] = {}
        self._path = ""
        self._method = ""
        self._body = bytearray()
        self._body_mode: int | None = None  # unknown until protocol_config says
        self._response_mode: int | None = None
        self._subset: tuple[str, ...] | None = None
        self._candidates: Sequence[Pod] = ()
        self._held = 0
        self._holding: HeldRequest | None = None
        # The decision (set from DECIDED on) and the router that made it (None for
        # a body-less request), for its shadows; its span; the pod's in-flight count.
        self._decision: Decision | None = None
        self._router: RouterLike | None = None
        self._span: RequestSpan | None = None
        self._load: InFlight | None = None
        self._prefill_load: InFlight | None = None
        self._queued: tuple[InFlight, int] | None = None
        # What the response's record reports (times from perf_counter).
        self._decided_at = 0.0
        self._status: int | None = None  # the response's, once its headers came
        self._to_headers = 0.0
        self._first_body_at: float | None = None
        self._usage: UsageReader | None = None
        self._ended_at = 0.0

    # -- dispatch -------------------------------------------------------------------

    def handle(self, message: pb.ProcessingRequest) -> Replies:
        """The replies to one message (``Replies``); never raises.

        None ends the exchange without a reply: the stream's status OK answers
        that message (see ``process_stream.py``).
        """
        phase = message.WhichOneof("request")
        try:
            if self._body_mode is None and message.HasField("protocol_config"):
                self._configure(message.protocol_config)  # sent with the first message only
            if phase == "request_headers":
                if message.HasField("metadata_context"):
                    self._subset = epp.subset_hint(message)
                return self._on_request_headers(message.request_headers)
            if phase == "request_body":
                return self._on_request_body(message.request_body)
            if phase == "request_trailers":
                return self._on_request_trailers()
            if phase == "response_headers":
                if message.HasField("metadata_context"):
                    self._served_by(epp.served_endpoint(message))
                return self._on_response_headers(message.response_headers)
            if phase == "response_body":
                return self._on_response_body(message.response_body)
            if phase == "response_trailers":
                self._end(State.ENDED)
                if self._response_mode == _DUPLEX:  # Envoy holds them until they are answered
                    return replies.RESPONSE_TRAILERS_CONTINUE
                return None
            raise RequestError.internal(f"unexpected ext_proc message {phase!r}")
        except RequestError as error:
            if self._span is None:
                self._report("rejected", error.code)
            return self._reject(error)
        except Exception:
            log.exception("request %s: internal error in phase %s", self._request_id, phase)
            self._report("internal", phase or "unknown")
            if phase is not None and phase.startswith("response"):
                return self._pass_on(phase, message)  # the response is on its way: never break it
            return self._reject(RequestError.internal())

    def _pass_on(self, phase: str, message: pb.ProcessingRequest) -> Replies:
        """The response message handed on unchanged, after policyd failed on it."""
        if phase == "response_body" and self._response_mode == _DUPLEX:
            body = message.response_body
            return replies.streamed_response_body(body.body, body.end_of_stream)
        return _CONTINUE[phase]

    def reply_sent(self) -> None:
        """The last reply ``handle`` gave went out (gRPC took it)."""
        state = self.state
        if state is State.DECIDED:
            self.state = State.ROUTED
            self._record_later(decision=True, end=False)
        elif state is State.ANSWERED:
            self.state = State.ENDED
            self._record_later(decision=True, end=True)

    def close(self, *, reset: bool = False) -> None:
        """The stream is gone (``reset``: cancelled, as Envoy's reset does).

        An exchange that had not ended is aborted; a reset after the end is
        a normal end, counted (``stream_error("reset", "after_end")``).
        """
        state = self.state
        if state is State.ENDED or state is State.ANSWERED:
            if reset:
                log.debug("ext_proc stream reset after its exchange ended")
                self._report("reset", "after_end")
            self.reply_sent()  # an answer whose reply never went out: over all the same
        elif state is not State.ABORTED:
            self._end(State.ABORTED)

    def _configure(self, config: pb.ProtocolConfiguration) -> None:
        self._body_mode = config.request_body_mode
        self._response_mode = config.response_body_mode

    # -- request path ---------------------------------------------------------------

    @property
    def _request_id(self) -> str:
        return self._headers.get("x-request-id", "-")

    def _on_request_headers(self, message: pb.HttpHeaders) -> Replies:
        # Pseudo-headers (:path, :method, ...) are not part of what policies see,
        # nor is a client's destination header.
        headers = self._headers
        size = 0
        for header in message.headers.headers:
            name = header.key.lower()  # Envoy's are already; other clients' may not be
            raw = header.raw_value
            value = raw.decode("utf-8", "replace") if raw else header.value
            size += len(name) + len(value)
            if name.startswith(":"):
                if name == ":path":
                    self._path = value.split("?", 1)[0]
                elif name == ":method":
                    self._method = value
            elif name in headers:
                headers[name] += "," + value
            elif name != replies.DESTINATION_HEADER:
                headers[name] = value
        settings = self._server.settings
        if size > settings.max_header_bytes:
            raise RequestError.over_limit(
                431,
                "the request headers are larger",
                settings.max_header_bytes,
                "headers_too_large",
            )
        if len(self._path) > settings.max_path_bytes:
            raise RequestError.over_limit(
                414, "the request path is longer", settings.max_path_bytes, "path_too_long"
            )
        if message.end_of_stream:
            if self._method in bodyless.METHODS:
                return self._route_without_body()
            raise RequestError.bad_request(
                "the request has no body: policyd routes OpenAI requests with a JSON body",
                "missing_body",
            )
        length = headers.get("content-length")
        if length is not None and length.isdigit():  # the body is on its way: gRPC will hold it
            self._hold(int(length) if len(length) < 19 else 1 << 63, reserve=True)
        if self._body_mode == _DUPLEX:
            return NO_REPLY  # the routing is this message's reply, once the body is in
        return self._server.route_replies.request_headers_continue

    def _hold(self, size: int, *, reserve: bool = False) -> None:
        """Hold ``size`` bytes of body in all (``reserve``: still to come); raises 413 or 429."""
        settings = self._server.settings
        if size > settings.max_body_bytes:
            raise RequestError.over_limit(
                413, "the request body is larger", settings.max_body_bytes, "body_too_large"
            )
        more = size - self._held
        if more <= 0:
            return
        budget = self._server.body_budget
        reserved = budget.reserve(self, more) if reserve else more if budget.take(more) else None
        if reserved is None:
            raise RequestError(
                429,
                "policyd holds as many request-body bytes as it may right now; retry shortly",
                "too_many_body_bytes",
                retry_after=RETRY_AFTER_SECONDS,
            )
        self._held += reserved

    def _let_go(self) -> None:
        """Give the body's bytes back to the budget: the body is no longer held."""
        if self._held:
            self._server.body_budget.give(self._held, self)
            self._held = 0

    def lapse(self) -> int:
        """The body budget takes back the reserved bytes that have not come (the
        body stalls); what has arrived stays held."""
        gone = max(self._held - len(self._body), 0)
        self._held -= gone
        return gone

    def _on_request_body(self, message: pb.HttpBody) -> Replies:
        if self.state is not State.READING:
            return replies.REQUEST_BODY_CONTINUE  # already routed; nothing left to decide
        chunk = message.body
        whole = message.end_of_stream or self._body_mode == _BodyMode.BUFFERED
        if whole and not self._body:  # the whole body in one message: no copy to gather it
            body = chunk
        else:
            self._body += chunk
            body = self._body
        if whole:
            self._server.body_budget.arrived(self)  # held now, however long it is held
        self._hold(len(body))
        if whole:
            try:
                return self._route(bytes(body))  # BUFFERED: one message, even with trailers
            finally:
                if self._holding is None:  # a held body stays counted until it goes
                    self._let_go()
        if self._body_mode == _BodyMode.BUFFERED_PARTIAL:
            raise RequestError(
                413, "the request body exceeds the proxy's buffer limit", "body_too_large"
            )
        if self._body_mode == _DUPLEX:
            return NO_REPLY  # gathered: all is answered once the body is in
        return replies.REQUEST_BODY_CONTINUE  # STREAMED: wait for the rest

    def _on_request_trailers(self) -> Replies:
        if self.state is State.READING:
            if self._body_mode == _DUPLEX:
                # The trailers say the body is whole: route it, then answer them.
                self._server.body_budget.arrived(self)
                try:
                    return self._route(bytes(self._body), trailers=True)
                finally:
                    if self._holding is None:
                        self._let_go()
            # A STREAMED body ended by trailers: a trailers reply cannot set the
            # destination, so the request cannot be routed.
            raise RequestError.bad_request(
                "request trailers are not supported by policyd's streamed body mode",
                "unsupported_trailers",
            )
        return replies.REQUEST_TRAILERS_CONTINUE

    def _candidates_now(self) -> Sequence[Pod]:
        """The pool's candidates, narrowed to the proxy's subset when it sent one."""
        candidates: Sequence[Pod] = self._server.snapshots().candidates
        if self._subset is not None:
            return self._server.subsets.narrow(candidates, self._subset)
        return candidates

    def _route(self, document: bytes, *, trailers: bool = False) -> Replies:
        """Decide where the request goes; the routing reply (replies, FULL_DUPLEX_STREAMED,
        ``trailers``: the body was ended by trailers, answered last), or a ``HeldReply``
        when flow control holds the request."""
        body = self._parse(document)
        if self._body:
            self._body = bytearray()  # gathered from several messages: let it go
        candidates: Sequence[Pod] | None = None
        router = self._server.routers()
        # Test and benchmark routers may have no flow control at all.
        admission_of = getattr(router, "admission", None)
        admission = admission_of(body.request) if admission_of is not None else None
        if admission is not None:
            holding = self._server.holding
            verdict = holding.control.arrive(admission, body.request, len(document), self)
            if isinstance(verdict, FlowAnswer):
                raise RequestError.from_flow(verdict)
            if isinstance(verdict, Held):
                self.state = State.HELD
                reply = HeldReply(verdict.band.max_wait_s)
                # Only the bytes are kept while held (the parsed document is several
                # times their size); the body is parsed again at dispatch.
                self._holding = HeldRequest(
                    reply, verdict, document, trailers, time.perf_counter(), body.request
                )
                holding.held()
                return reply
            candidates = verdict.candidates
        return self._decide_and_reply(body, document, trailers, candidates, router)

    def _parse(self, document: bytes) -> InferenceBody:
        """The body and its request, the pool's objective and model rewrite applied."""
        return applied(self._parsed(document), self._server.objects(), self._server.rng)

    def _parsed(self, document: bytes) -> InferenceBody:
        return parse_body(
            document, self._path, self._server.settings.max_model_bytes, headers=self._headers
        )

    def _decide_and_reply(
        self,
        body: InferenceBody,
        document: bytes,
        trailers: bool,
        candidates: Sequence[Pod] | None,
        router: RouterLike,
    ) -> Replies:
        """Decide over ``candidates`` (None: the pool's) and build the routing reply."""
        request = body.request
        started = time.perf_counter()
        flow_controlled = candidates is not None
        pods: Sequence[Pod] = ()
        try:
            pods = candidates if candidates is not None else self._candidates_now()
            self._router = router
            locator = self._server.prefix
            prompt = locator.probe(body.turns) if locator is not None and body.turns else None
            decision = self._checked(router.decide(request, pods, prompt))
            if prompt is not None and decision.best_prefix_match is not None:
                # The policy matched the prompt: approximate mode remembers its blocks,
                # on the prefill pod too when it computes them (it keeps them cached).
                prompt.routed(decision.target_model, decision.endpoint)
                split = decision.split
                if split is not None and split.split:
                    prompt.routed(decision.target_model, split.endpoint)
        except RequestError:
            raise  # the proxy's subset has none of the pool's pods: a 503 of its own
        except Exception as error:
            log.exception("request %s: the router raised", request.id or "-")
            reason = f"the routing policy failed on this request ({type(error).__name__})"
            decision = Decision(Outcome.ERROR, "", "", request.model, reason=reason)
        hold = self._holding
        if hold is not None:
            decision.held_seconds = started - hold.since
            decision.queue_position = hold.held.position
        span = self._decided(request, decision, started)
        self._claim(decision, pods, uncached_prompt(request.prompt_tokens, decision.prefix_match))
        if flow_controlled and hold is None:  # a dispatched one, flow control counts itself
            self._server.holding.control.sent(decision.pod, self)
        settings = self._server.settings
        destination = replies.destination_value(
            decision.endpoint, decision.fallbacks if settings.send_fallbacks else ()
        )
        target = decision.target_model or request.model
        # The body's own model: an InferenceModelRewrite may have renamed the request.
        new_body = rewrite_model(body, target) if target != body.document["model"] else None
        upstream_headers = self._upstream_headers(span)
        split = decision.split
        if split is not None and split.split:
            # The decode pod's sidecar asks this pod to prefill (docs/disaggregation.md).
            prefill_header = self._server.route_replies.prefill_header
            upstream_headers = {**upstream_headers, prefill_header: split.endpoint}
        if self._body_mode != _DUPLEX:
            return self._server.route_replies.route(destination, upstream_headers, new_body)
        routing = self._server.route_replies.route_before_body(
            destination, upstream_headers, None if new_body is None else len(new_body)
        )
        sent_body = replies.streamed_request_body(
            document if new_body is None else new_body, end_of_stream=not trailers
        )
        if trailers:
            return (routing, *sent_body, replies.REQUEST_TRAILERS_CONTINUE)
        return (routing, *sent_body)

    # -- held by flow control (``policyd.flow``'s ``Waiter``) -------------------------

    def dispatch(self, candidates: Sequence[Any]) -> str | None:
        """Flow control dispatches the held request over ``candidates`` (the pods with
        room): decide it now and hand the routing reply to the waiting stream."""
        hold = self._holding
        if hold is None or self.state is not State.HELD:
            return None
        self.state = State.READING
        try:
            document = hold.document
            body = dataclasses.replace(self._parsed(document), request=hold.admitted)
            reply = self._decide_and_reply(
                body, document, hold.trailers, candidates, self._server.routers()
            )
        except RequestError as error:
            reply = self._reject(error)
        except Exception:
            log.exception("request %s: internal error at dispatch", self._request_id)
            self._report("internal", "dispatch")
            reply = self._reject(RequestError.internal())
        finally:
            self._holding = None
            self._let_go()
        hold.reply.resolve(reply)
        decision = self._decision
        return decision.pod if decision is not None and self._load is not None else None

    def answer(self, answer: FlowAnswer) -> None:
        """Flow control answers the held request (expired, evicted, shutting down)."""
        hold = self._holding
        if hold is None or self.state is not State.HELD:
            return
        self._holding = None
        self.state = State.READING
        self._report("rejected", answer.code)
        hold.reply.resolve(self._reject(RequestError.from_flow(answer)))

    def _route_without_body(self) -> bytes:
        """Send a body-less GET or HEAD to the least busy ready pod (``bodyless``)."""
        request = request_without_body(self._headers, self._path)
        candidates = self._candidates_now()
        started = time.perf_counter()
        decision = bodyless.least_busy_pod(candidates, self._server.rng)
        span = self._decided(request, decision, started)
        self._claim(decision, candidates, 0)
        return replies.route_headers(
            decision.endpoint,
            self._upstream_headers(span),
            self._server.route_replies.prefill_header,
        )

    def _claim(self, decision: Decision, candidates: Sequence[Pod], prefill: int) -> None:
        """Count the request on its pod(s), its ``prefill`` tokens on the pod prefilling it."""
        load = self._load = _claim(decision, candidates)
        if load is not None:
            self._candidates = candidates
            self._server.response_watch.watch(self)
            split = decision.split
            if split is not None and isinstance(split.chosen, Pod):
                # The prefill pod works for this request too until its answer ends.
                split.chosen.load.count += 1
                self._prefill_load = split.chosen.load
            if prefill > 0:
                prefilling = self._prefill_load or load
                prefilling.prefill_tokens += prefill
                self._queued = (prefilling, prefill)

    def _served_by(self, endpoint: str) -> None:
        """The proxy says ``endpoint`` served the request (``epp``): when that is not
        the pod counted (a fallback served it), count it there instead."""
        load = self._load
        decision = self._decision
        if not endpoint or load is None or decision is None or endpoint == decision.endpoint:
            return
        for pod in self._candidates:
            if pod.address == endpoint:
                if pod.load is not load:
                    load.count -= 1
                    pod.load.count += 1
                    self._load = pod.load
                    queued = self._queued
                    if queued is not None and queued[0] is load:  # it prefills there too
                        load.prefill_tokens -= queued[1]
                        pod.load.prefill_tokens += queued[1]
                        self._queued = (pod.load, queued[1])
                return

    @property
    def routed_at(self) -> float:
        """When the request was decided (``time.perf_counter``)."""
        return self._decided_at

    def expire(self) -> bool:
        """No response headers in time: stop counting in the pod's in-flight (``ResponseWatch``).

        Whether the count was released (the exchange may have moved on).
        """
        if self._load is None:  # released already: the exchange ended
            return False
        self._load.count -= 1
        self._load = None
        self._release_prefill()
        self._release_queued()
        if self._decision is not None:
            self._server.holding.finished(self._decision.pod, self)  # counted free: a slot
        self._report("expired", "no_response_headers")
        return True

    def _decided(self, request: Request, decision: Decision, started: float) -> RequestSpan:
        """Open the decision's span; a decision that did not route becomes its error."""
        self._decided_at = time.perf_counter()
        self._decision = decision
        span = self._span = self._start_span(request, decision, self._decided_at - started)
        self.state = State.DECIDED
        if decision.outcome is not Outcome.ROUTED:
            raise RequestError.from_decision(decision)
        return span

    def _checked(self, decision: Decision) -> Decision:
        """A routed decision must name an endpoint; one that does not is a router bug."""
        if decision.outcome is Outcome.ROUTED and not decision.endpoint:
            log.error("request %s: routed decision without an endpoint", self._request_id)
            return Decision(
                Outcome.ERROR,
                decision.policy,
                decision.policy_version,
                decision.target_model,
                reason="the routing policy chose no endpoint",
            )
        return decision

    def _start_span(self, request: Request, decision: Decision, seconds: float) -> RequestSpan:
        carrier = TraceCarrier(self._metadata, self._headers)
        try:
            return self._server.telemetry.start(request, decision, carrier, seconds)
        except Exception:
            log.exception("request %s: telemetry failed to start a span", request.id or "-")
            return NULL_SPAN

    def _upstream_headers(self, span: RequestSpan) -> Mapping[str, str]:
        try:
            return span.upstream_headers
        except Exception:
            log.exception("request %s: telemetry failed to give trace headers", self._request_id)
            return {}

    def _reject(self, error: RequestError) -> bytes:
        if self._span is not None:
            self._status, self._to_headers = error.status, self._elapsed()
        self._end(State.ANSWERED)
        log.debug("request %s: %d %s", self._request_id, error.status, error.message)
        return replies.immediate(error)

    # -- response path --------------------------------------------------------------

    def _on_response_headers(self, message: pb.HttpHeaders) -> Replies:
        status = 0
        content_type = ""
        for header in message.headers.headers:
            key = header.key
            if key == ":status":
                status = int(_value(header) or 0)
            elif key == "content-type":
                content_type = _value(header)
            else:
                continue
            if status and content_type:
                break
        self._usage = UsageReader(content_type, self._server.usage_budget)
        if self.state is State.ROUTED:
            self.state = State.RESPONDING
            if self._load is not None:
                self._server.response_watch.forget(self)
        # The decode pod's sidecar answers only once its prefill pod has answered:
        # from here the prefill pod's share of this request is done.
        self._release_prefill()
        if self._span is not None:
            self._status, self._to_headers = status, self._elapsed()
        if message.end_of_stream:
            self._end(State.ENDED)
            return None
        return replies.RESPONSE_HEADERS_CONTINUE

    def _on_response_body(self, message: pb.HttpBody) -> Replies:
        chunk = message.body  # each read of a bytes field makes a new copy
        if self._first_body_at is None and chunk:
            self._first_body_at = time.perf_counter()
            self._release_queued()  # a first token: its prefill is done
        if self._usage is not None:
            self._usage.feed(chunk)
        if self._response_mode == _DUPLEX:
            # Envoy forwards only what comes back, the last chunk too: it is
            # answered, and the stream ends once that reply is out.
            if message.end_of_stream:
                self._end(State.ENDED)
            return replies.streamed_response_body(chunk, message.end_of_stream)
        if message.end_of_stream:
            self._end(State.ENDED)
            return None
        return replies.RESPONSE_BODY_CONTINUE

    # -- the end, and the bookkeeping after the reply -------------------------------

    def _end(self, end: State) -> None:
        """End the exchange as ``end`` (ENDED, ANSWERED or ABORTED), once.

        The body budget and the pod's in-flight count are let go now, since
        routing reads them; the bookkeeping is queued once the reply carrying
        the decision is out.
        """
        before = self.state
        if before in OVER:
            return
        self._ended_at = time.perf_counter()
        self._let_go()
        if self._usage is not None:
            self._usage.finish()  # read now: the response's bytes go back to the budget
        hold = self._holding
        if hold is not None:  # the client went away while held: out of the queue at once
            self._holding = None
            self._server.holding.control.leave(hold.held)
        if end is State.ABORTED:
            self._report("aborted", "decided" if self._span is not None else "undecided")
        load = self._load
        if load is not None:
            self._server.response_watch.forget(self)
            load.count -= 1
            self._load = None
            self._release_prefill()
            self._release_queued()
            if self._decision is not None:
                usage = self._usage if end is State.ENDED else None
                self._server.holding.finished(self._decision.pod, self, usage)  # a slot is free
        if end is State.ANSWERED and (before is State.ROUTED or before is State.RESPONDING):
            end = State.ENDED  # the decision's reply is out already: nothing waits for this one
        self.state = end
        if end is not State.ANSWERED:  # an answer is recorded once it is out (reply_sent)
            self._record_later(decision=before is State.DECIDED, end=True)

    def _release_prefill(self) -> None:
        """Stop counting a split request on its prefill pod, its queued prefill too."""
        prefill = self._prefill_load
        if prefill is not None:
            prefill.count -= 1
            self._prefill_load = None
            queued = self._queued
            if queued is not None and queued[0] is prefill:
                self._release_queued()

    def _release_queued(self) -> None:
        """Take the request's prefill out of its pod's queued prefill, once."""
        queued = self._queued
        if queued is not None:
            queued[0].prefill_tokens -= queued[1]
            self._queued = None

    def _record_later(self, *, decision: bool, end: bool) -> None:
        """Queue the bookkeeping now due, in order: the one place it is deferred.

        Run by the settlement a few milliseconds later (see ``settlement.py``).
        The decision's record is queued once its reply is out, the response's
        with it or after it, so telemetry always gets ``after_reply`` first.
        """
        if self._span is None:
            return  # answered before any decision: nothing to record
        add = self._server.settlement.add
        if decision:
            add(self._record_decision)
        if end:
            add(self._record_end)

    def _record_decision(self) -> None:
        """The decision's shadow policies decided, and everything handed to telemetry."""
        span, decision = self._span, self._decision
        if span is None or decision is None:
            return
        shadows: ShadowReport | None = None
        if decision.shadow_inputs is not None and self._router is not None:
            try:
                shadows = self._router.decide_shadows(decision)
            except Exception:
                log.exception("request %s: the shadow policies failed", self._request_id)
        self._safely(span.after_reply, shadows)

    def _record_end(self) -> None:
        """How the response ended, handed to telemetry (the exchange is over)."""
        span = self._span
        if span is None:
            return
        if self._status is not None:
            self._safely(span.response_headers, self._status, self._to_headers)
        try:
            usage = self._usage.finish() if self._usage is not None else None
            first_body = (
                self._first_body_at - self._decided_at if self._first_body_at is not None else None
            )
            span.end(
                ExchangeEnd(
                    self.state is not State.ABORTED,
                    self._ended_at - self._decided_at,
                    first_body,
                    usage.prompt_tokens if usage else None,
                    usage.completion_tokens if usage else None,
                    usage.cached_tokens if usage else None,
                )
            )
        except Exception:
            log.exception("request %s: telemetry failed to end a span", self._request_id)

    def _elapsed(self) -> float:
        return time.perf_counter() - self._decided_at

    def _report(self, kind: str, code: str) -> None:
        self._safely(self._server.telemetry.stream_error, kind, code)

    def _safely(self, call: Callable[..., object], *arguments: object) -> None:
        try:
            call(*arguments)
        except Exception:
            log.exception("request %s: telemetry hook failed", self._request_id)


def _claim(decision: Decision, candidates: Sequence[Pod]) -> InFlight | None:
    """Count the request against the chosen pod until its exchange ends.

    The router hands over the pod it picked; a router that names only the pod
    or endpoint (a test's, a benchmark's) has it looked up among the candidates.
    """
    if isinstance(decision.chosen, Pod):
        decision.chosen.load.count += 1
        return decision.chosen.load
    for pod in candidates:
        if pod.name == decision.pod or (not decision.pod and pod.address == decision.endpoint):
            pod.load.count += 1
            return pod.load
    return None


def _value(header: Any) -> str:
    return header.raw_value.decode("utf-8", "replace") if header.raw_value else str(header.value)


_CONTINUE: Final[dict[str, bytes]] = {
    "response_headers": replies.RESPONSE_HEADERS_CONTINUE,
    "response_body": replies.RESPONSE_BODY_CONTINUE,
    "response_trailers": replies.RESPONSE_TRAILERS_CONTINUE,
}
