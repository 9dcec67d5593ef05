"""Open-loop experiments in virtual time: requests arrive on their own clock, with their prompts.

The seed experiment (``experiment.py``) is closed-loop: a fixed pool of
connections, one fixed 17-token prompt. Prefix-cache routing needs the
opposite: requests that arrive when their users send them (Poisson arrivals,
or the next turn of a chat some seconds after the previous answer), each with
its own prompt token ids, model (an adapter or the base model) and output
length, so that where a request lands decides how much of its prompt the pod
already holds.

What the routing function may see, as a router in front of the pods would:

- every pod's metrics as last scraped (every ``scrape_interval_s``) and the
  router's own count of requests in flight per pod (``PodView``, as in the
  seed experiment);
- the request: model, prompt as turns and token ids (``Arrival``);
- for precise prefix routing, the pods' KV-cache events (``BlocksStored`` /
  ``BlocksRemoved`` / ``AllBlocksCleared`` from each pod's block manager),
  handed to a ``kv_events`` sink ``kv_event_delay_s`` after the step that
  produced them (vLLM publishes after every engine step; the delay stands for
  ZMQ delivery and the subscriber's batching);
- for the oracle only, ``Arrival.truth``: each pod's true prefix-cache
  contents and load at this instant. A real router cannot read it.

The run records per request its arrival, pod, time to first token,
completion, prompt tokens and the prompt tokens its pod found cached; and how
many requests each pod got. A client gives up ``timeout_s`` after sending (the
pod aborts the request); a chat session whose turn timed out sends no more
turns. The run is deterministic under its seed.

    from policyd.sim.open_loop import run_open_loop
    from policyd.sim.workloads import SharedPrefix
    requests = SharedPrefix().requests(rate=2.0, duration_s=60.0, seed=1)
    result = run_open_loop(lambda arrival, pods, rng: rng.randrange(len(pods)), requests, seed=1)
    print(result.summary())
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from policyd.sim.blocks import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent, prefix_keys
from policyd.sim.engine import RemotePrefill, RequestState, SimRequest
from policyd.sim.experiment import PodView, percentile, pod_views
from policyd.sim.names import pod_name
from policyd.sim.profile import L4_LLAMA2_7B, Profile
from policyd.sim.virtual import Timer, VirtualLoop, VirtualPod


@dataclass(frozen=True, slots=True)
class Turn:
    """One piece of a prompt as the client sent it (``policyd.prefix``'s ``TurnLike``).

    ``role`` is a chat message's role, or ``None`` for bare completions input;
    ``texts`` its text parts; ``token_ids`` the ids when the prompt was sent as ids.
    """

    role: str | None
    texts: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class OpenRequest:
    """One request of an open-loop workload.

    ``prompt`` holds the token ids the pod computes (``policyd.sim.tokenizer``
    applied to ``turns``, as the simulated HTTP front would). ``adapter`` is
    the LoRA adapter asked for, ``None`` for the base model. A request with
    ``follows`` set is the next turn of a chat session: it is sent ``at_s``
    seconds (the user's think time) after request ``follows`` completes, and
    never if that one did not complete; otherwise it is sent at ``at_s``
    seconds from the start. ``group`` labels what it shares (a system prompt,
    a session) for reports.
    """

    at_s: float
    adapter: str | None
    turns: tuple[Turn, ...]
    prompt: tuple[int, ...]
    output_length: int
    max_tokens: int
    follows: int | None = None
    group: str = ""

    def __post_init__(self) -> None:
        if self.at_s < 0 or not self.prompt or self.output_length < 1 or self.max_tokens < 1:
            raise ValueError("a request needs at_s >= 0, a prompt and positive lengths")


class PoolTruth:
    """Each pod's true prefix-cache contents and load: what only the oracle may read.

    The cache contents are mirrored from the pods' own KV events, drained
    before every routing decision, so they are exact at that instant: a block
    is listed while the pod can still serve it from its cache.
    """

    def __init__(self, pods: Sequence[VirtualPod], block_size: int) -> None:
        self._pods = pods
        self._block_size = block_size
        self._keys: list[set[int]] = [set() for _ in pods]

    def apply(self, pod: int, events: Sequence[KvEvent]) -> None:
        keys = self._keys[pod]
        for event in events:
            if isinstance(event, BlocksStored):
                keys.update(event.block_hashes)
            elif isinstance(event, BlocksRemoved):
                keys.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                keys.clear()

    def cached_tokens(self, pod: int, keys: Sequence[int], prompt_tokens: int) -> int:
        """Prompt tokens ``pod`` would find cached for a prompt of ``keys`` (engine rules)."""
        held = self._keys[pod]
        blocks = 0
        for key in keys:
            if key not in held:
                break
            blocks += 1
        return min(blocks * self._block_size, prompt_tokens - 1)

    def load(self, pod: int) -> int:
        """Requests on the pod now, waiting or running."""
        engine = self._pods[pod].engine
        return len(engine.waiting) + len(engine.running)

    def kv_cache_usage(self, pod: int) -> float:
        """Fraction of the pod's KV blocks in use now."""
        return self._pods[pod].engine.snapshot().kv_cache_usage


@dataclass(frozen=True, slots=True)
class Arrival:
    """The request being routed, as a router sees it (``truth`` is for the oracle only).

    ``model`` is the name the request asks for: the adapter's, or the base
    model's. ``keys`` are the pods' own prefix-cache keys of the prompt, for
    the oracle's look-ups in ``truth``.
    """

    index: int
    model: str
    turns: tuple[Turn, ...]
    prompt: tuple[int, ...]
    max_tokens: int
    at: float
    truth: PoolTruth
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Split:
    """A disaggregated route: ``prefill`` computes the prompt, ``decode`` generates."""

    decode: int
    prefill: int


OpenRoutingFunction = Callable[[Arrival, Sequence[PodView], random.Random], int | Split]
"""Picks the index of the pod that serves a request, or a ``Split`` of two; may draw from
the given generator."""

KvEventSink = Callable[[int, Sequence[KvEvent]], None]
"""Receives one pod's KV events (pod index, events in order), as a subscriber would."""


def uniform_random(arrival: Arrival, pods: Sequence[PodView], rng: random.Random) -> int:
    """A Kubernetes Service: every request to a pod chosen uniformly at random."""
    return rng.randrange(len(pods))


@dataclass(frozen=True, slots=True)
class OpenRecord:
    """What happened to one request (times in virtual seconds from the start).

    ``sent`` is ``None`` for a chat turn never sent (its previous turn did not
    complete). ``cached_tokens`` are the prompt tokens its pod found in the
    prefix cache when it first admitted it (``None`` if never admitted).
    """

    index: int
    model: str
    group: str
    sent: float | None
    pod: int | None
    first_token: float | None
    finished: float | None
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int
    prefill_pod: int | None = None  # for a split request, the pod that prefilled it

    @property
    def completed(self) -> bool:
        return self.finished is not None


@dataclass(frozen=True, slots=True)
class OpenLoopResult:
    """The outcome of one open-loop run and the figures derived from it.

    ``duration_s`` runs from the start to the last request's end (completed or
    timed out); throughput counts the output tokens of completed requests.
    """

    records: tuple[OpenRecord, ...]
    duration_s: float
    pods: int
    token_gaps_s: tuple[float, ...] = ()  # every gap between two tokens of one answer

    @property
    def sent(self) -> int:
        return sum(1 for r in self.records if r.sent is not None)

    @property
    def completed(self) -> int:
        return sum(1 for r in self.records if r.completed)

    @property
    def output_tokens_per_s(self) -> float:
        tokens = sum(r.output_tokens for r in self.records if r.completed)
        return tokens / self.duration_s if self.duration_s > 0 else 0.0

    def ttft_s(self) -> list[float]:
        """Time to first token of every sent request; ``inf`` for one that never got one."""
        return [
            math.inf if r.first_token is None else r.first_token - r.sent
            for r in self.records
            if r.sent is not None
        ]

    @property
    def split_share(self) -> float:
        """The share of sent requests that a prefill pod prefilled for their decode pod."""
        sent = [r for r in self.records if r.sent is not None]
        return sum(1 for r in sent if r.prefill_pod is not None) / len(sent) if sent else 0.0

    @property
    def hit_rate(self) -> float:
        """The pool's prefix-cache hit rate: cached / all prompt tokens of the admitted requests."""
        admitted = [r for r in self.records if r.cached_tokens is not None]
        prompt = sum(r.prompt_tokens for r in admitted)
        return sum(r.cached_tokens or 0 for r in admitted) / prompt if prompt else 0.0

    def requests_per_pod(self) -> list[int]:
        counts = [0] * self.pods
        for r in self.records:
            if r.pod is not None:
                counts[r.pod] += 1
        return counts

    @property
    def load_imbalance(self) -> float:
        """The busiest pod's request count over the mean (1.0 is perfectly even)."""
        counts = self.requests_per_pod()
        mean = sum(counts) / len(counts)
        return max(counts) / mean if mean else 1.0

    def summary(self) -> str:
        ttft = self.ttft_s()
        return (
            f"completed {self.completed}/{self.sent}, {self.output_tokens_per_s:.0f} output "
            f"tokens/s over {self.duration_s:.1f} s, TTFT p50/p90/p99 "
            f"{percentile(ttft, 0.5):.2f}/{percentile(ttft, 0.9):.2f}/"
            f"{percentile(ttft, 0.99):.2f} s, prefix-cache hit rate {self.hit_rate:.1%}, "
            f"max/mean load {self.load_imbalance:.2f}"
        )


class _OpenRun:
    """One open-loop run's moving parts on one virtual loop."""

    def __init__(
        self,
        *,
        route: OpenRoutingFunction,
        requests: Sequence[OpenRequest],
        pods: int,
        profile: Profile,
        seed: int,
        scrape_interval_s: float,
        timeout_s: float,
        kv_events: KvEventSink | None,
        kv_event_delay_s: float,
        on_done: Callable[[int], None] | None,
    ) -> None:
        self.route = route
        self.on_done = on_done
        self.requests = requests
        self.profile = profile
        self.scrape_interval_s = scrape_interval_s
        self.timeout_s = timeout_s
        self.kv_events = kv_events
        self.kv_event_delay_s = kv_event_delay_s
        self.loop = VirtualLoop()
        self.pods = [
            VirtualPod(self.loop, profile, name=pod_name(i), seed=seed * 1000 + i)
            for i in range(pods)
        ]
        for pod in self.pods:
            pod.engine.record_kv_events()
        self.truth = PoolTruth(self.pods, profile.block_size)
        self.sampled = [(pod.snapshot(), 0.0) for pod in self.pods]
        self.in_flight = [0] * pods
        self.router_rng = random.Random(f"router-{seed}")
        count = len(requests)
        self.followers: dict[int, int] = {}
        for index, request in enumerate(requests):
            if request.follows is not None:
                if not 0 <= request.follows < index or request.follows in self.followers:
                    raise ValueError(
                        f"request {index} follows {request.follows}: "
                        "not an earlier request that no other follows"
                    )
                self.followers[request.follows] = index
        # A profile drawing output lengths below max_tokens takes the workload's
        # length as the cap and draws the text's own, per request index, so
        # every router faces the same lengths.
        self.lengths = [
            request.output_length
            if profile.output_share_of_max_tokens is None
            else profile.natural_output_tokens(
                random.Random(f"output-{seed}-{index}"), request.max_tokens
            )
            for index, request in enumerate(requests)
        ]
        self.sent: list[float | None] = [None] * count
        self.pod_of: list[int | None] = [None] * count
        self.states: list[RequestState | None] = [None] * count
        self.cached: list[int | None] = [None] * count
        self.timers: list[Timer | None] = [None] * count
        self.finished: list[float | None] = [None] * count
        self.prefill_of: list[int | None] = [None] * count
        self.prefill_states: list[RequestState | None] = [None] * count
        self.last_token: list[float | None] = [None] * count
        self.token_gaps: list[float] = []
        self.prefill_leg = _PrefillLeg(self)
        self.unresolved = count
        self.last_resolution = 0.0

    def run(self) -> OpenLoopResult:
        self.loop.call_at(0.0, self._scrape)
        for index, request in enumerate(self.requests):
            if request.follows is None:
                self.loop.call_at(request.at_s, partial(self._send, index))
        if not self.requests:
            return OpenLoopResult((), 0.0, len(self.pods))
        self.loop.run()
        return OpenLoopResult(
            self._records(), self.last_resolution, len(self.pods), tuple(self.token_gaps)
        )

    def _scrape(self) -> None:
        now = self.loop.now
        self.sampled = [(pod.snapshot(), now) for pod in self.pods]
        if self.unresolved:
            self.loop.call_later(self.scrape_interval_s, self._scrape)

    def _drain(self, pod: int) -> None:
        """Take the pod's KV events: the truth now, the sink after the delivery delay."""
        events = self.pods[pod].engine.take_kv_events()
        if not events:
            return
        self.truth.apply(pod, events)
        if self.kv_events is not None:
            self.loop.call_later(self.kv_event_delay_s, partial(self.kv_events, pod, events))

    def _send(self, index: int) -> None:
        now = self.loop.now
        request = self.requests[index]
        for pod in range(len(self.pods)):
            self._drain(pod)
        model = request.adapter or self.profile.base_model
        arrival = Arrival(
            index,
            model,
            request.turns,
            request.prompt,
            request.max_tokens,
            now,
            self.truth,
            prefix_keys(model, request.prompt, self.profile.block_size),
        )
        route = self.route(arrival, self._views(now), self.router_rng)
        pod, prefill = (route.decode, route.prefill) if isinstance(route, Split) else (route, None)
        for chosen in (pod, prefill):
            if chosen is not None and not 0 <= chosen < len(self.pods):
                raise ValueError(f"routing function chose pod {chosen} of {len(self.pods)}")
        self.in_flight[pod] += 1
        self.pod_of[index] = pod
        self.sent[index] = now
        self.timers[index] = self.loop.call_later(self.timeout_s, partial(self._time_out, index))
        if prefill is None:
            self._decode(index)
            return
        # The decode pod's sidecar has the prefill pod compute the prompt (one token, its
        # blocks kept for the pull), then sends its own pod the decode, which pulls them.
        self.in_flight[prefill] += 1
        self.prefill_of[index] = prefill
        self.prefill_states[index] = self.pods[prefill].submit(
            SimRequest(
                str(index), request.prompt, 1, adapter=request.adapter, output_length=1,
                listener=self.prefill_leg, remote_decode=True,
            )
        )  # fmt: skip

    def _decode(self, index: int, remote: RemotePrefill | None = None) -> None:
        request, pod = self.requests[index], self.pod_of[index]
        assert pod is not None
        self.states[index] = self.pods[pod].submit(
            SimRequest(
                str(index),
                request.prompt,
                request.max_tokens,
                adapter=request.adapter,
                output_length=self.lengths[index],
                listener=self,
                remote_prefill=remote,
            )
        )

    def prefilled(self, state: RequestState) -> None:
        """A prefill pod finished request ``index``'s prompt: its decode pod gets the decode
        half, which waits for the KV it does not hold (the engine's transfer time)."""
        index = int(state.request.request_id)
        prefill = self.prefill_of[index]
        assert prefill is not None
        self._drain(prefill)
        self.in_flight[prefill] -= 1
        self.prefill_states[index] = None
        if self.finished[index] is not None or self.timers[index] is None:
            return  # the client gave up while it was prefilled
        self._decode(index, RemotePrefill(pod_name(prefill), state.sent_blocks))

    def _views(self, now: float) -> list[PodView]:
        return pod_views(self.pods, self.sampled, self.in_flight, now)

    def on_progress(self, state: RequestState, now: float) -> None:
        index = int(state.request.request_id)
        pod = self.pod_of[index]
        assert pod is not None
        if self.cached[index] is None:  # its first token: the admission that counted the cache
            self.cached[index] = state.cached_tokens
        last = self.last_token[index]
        if last is not None:
            self.token_gaps.append(now - last)
        self.last_token[index] = now
        self._drain(pod)
        if not state.finished:
            return
        self.finished[index] = now
        timer = self.timers[index]
        if timer is not None:
            timer.cancel()
        self._resolve(index)
        follower = self.followers.get(index)
        if follower is not None:
            self.loop.call_later(self.requests[follower].at_s, partial(self._send, follower))

    def _time_out(self, index: int) -> None:
        state, pod = self.states[index], self.pod_of[index]
        self.timers[index] = None
        if state is not None and pod is not None:
            self.pods[pod].abort(state)
        prefilling, prefill = self.prefill_states[index], self.prefill_of[index]
        if prefilling is not None and prefill is not None:
            self.pods[prefill].abort(prefilling)
            self.in_flight[prefill] -= 1
            self.prefill_states[index] = None
        self._resolve(index)
        follower = self.followers.get(index)
        while follower is not None:  # the session ends: its later turns are never sent
            self.unresolved -= 1
            follower = self.followers.get(follower)

    def _resolve(self, index: int) -> None:
        self.unresolved -= 1
        self.last_resolution = self.loop.now
        pod = self.pod_of[index]
        if pod is not None:
            self.in_flight[pod] -= 1
            if self.on_done is not None:
                self.on_done(index)

    def _records(self) -> tuple[OpenRecord, ...]:
        records = []
        for index, request in enumerate(self.requests):
            state = self.states[index]
            records.append(
                OpenRecord(
                    index,
                    request.adapter or self.profile.base_model,
                    request.group,
                    self.sent[index],
                    self.pod_of[index],
                    state.first_token_at if state is not None else None,
                    self.finished[index],
                    len(request.prompt),
                    self.cached[index],
                    state.generated if state is not None else 0,
                    self.prefill_of[index],
                )
            )
        return tuple(records)


class _PrefillLeg:
    """The listener of the prefill halves of a run's disaggregated requests."""

    def __init__(self, run: _OpenRun) -> None:
        self.run = run

    def on_progress(self, state: RequestState, now: float) -> None:
        if state.finished:
            self.run.prefilled(state)


def run_open_loop(
    route: OpenRoutingFunction,
    requests: Sequence[OpenRequest],
    *,
    pods: int = 6,
    profile: Profile = L4_LLAMA2_7B,
    seed: int = 0,
    scrape_interval_s: float = 0.1,
    timeout_s: float = 120.0,
    kv_events: KvEventSink | None = None,
    kv_event_delay_s: float = 0.005,
    on_done: Callable[[int], None] | None = None,
) -> OpenLoopResult:
    """Serve ``requests`` (arrival times and prompts fixed by the workload) over ``pods`` pods.

    ``kv_events`` receives every pod's KV events ``kv_event_delay_s`` after
    the step that produced them (precise prefix routing's input). ``on_done``
    is told the index of every sent request that ended, completed or timed
    out, when the router's own in-flight count drops (a router keeping counts
    of its own, such as one of several replicas, needs it).
    """
    if pods < 1:
        raise ValueError("an experiment needs at least one pod")
    if scrape_interval_s <= 0 or timeout_s <= 0 or kv_event_delay_s < 0:
        raise ValueError("the scrape interval and timeout must be positive, the delay not negative")
    run = _OpenRun(
        route=route,
        requests=requests,
        pods=pods,
        profile=profile,
        seed=seed,
        scrape_interval_s=scrape_interval_s,
        timeout_s=timeout_s,
        kv_events=kv_events,
        kv_event_delay_s=kv_event_delay_s,
        on_done=on_done,
    )
    return run.run()


class Oracle:
    """The reference router: reads each pod's true cache contents and load (``Arrival.truth``).

    Among the pods whose load (requests waiting or running) is at most the
    least loaded pod's plus ``margin``, it picks the one holding the most of
    the prompt in its cache; ties go to the less loaded pod, then the lower
    index. The margin is what keeps a popular prefix from melting its pod:
    locality wins only while it costs at most ``margin`` requests of queue.
    8 was measured best over 3 seeds: on ``shared-prefix`` margins of 1, 2
    and 4 requests give up hit rate (56%, 65%, 73% at 1 request/s against
    75% for 8) for no better TTFT, and 16 lets queues grow at 2 requests/s
    (TTFT p90 4.2 s against 1.1 s); on ``multi-turn`` 4 and 8 are within
    noise of each other and 16 hot-spots (max/mean load 1.69).
    """

    def __init__(self, margin: int = 8) -> None:
        if margin < 0:
            raise ValueError("the load margin cannot be negative")
        self.margin = margin

    def __call__(self, arrival: Arrival, pods: Sequence[PodView], rng: random.Random) -> int:
        truth = arrival.truth
        loads = [truth.load(view.index) for view in pods]
        ceiling = min(loads) + self.margin
        best = max(
            (
                truth.cached_tokens(view.index, arrival.keys, len(arrival.prompt)),
                -load,
                -view.index,
            )
            for view, load in zip(pods, loads, strict=True)
            if load <= ceiling
        )
        return -best[2]
