"""The seed experiment in virtual time, with a pluggable routing function.

The published experiment: 1000 requests fired at once through a client pool of
100 connections, each naming one of 12 LoRA adapters at random, the same
short prompt (``SEED_PROMPT_TEXT``) and ``max_tokens`` 750, each given 300 s counted from its start
(waiting for a connection included), over 6 vLLM pods. A request is routed
when it gets a connection; the routing function sees what a router in front of
the pods would: every pod's metrics as last scraped (every 100 ms by default,
so up to that stale) and the router's own count of its requests in flight per
pod. The run is deterministic under its seed and takes seconds of wall time.

    from policyd.sim.experiment import run_experiment, uniform_random
    result = run_experiment(uniform_random, seed=1)
    print(result.completed, result.output_tokens_per_s)
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from policyd.sim.engine import EngineSnapshot, RequestState, SimRequest
from policyd.sim.names import adapter_names, pod_name
from policyd.sim.profile import L4_LLAMA2_7B, Profile
from policyd.sim.tokenizer import tokenize
from policyd.sim.virtual import Timer, VirtualLoop, VirtualPod

# The published experiment's prompt, the same for every request, and its token ids
# as a simulated pod counts them (a beginning-of-sequence token and 11 words).
SEED_PROMPT_TEXT = "Is the Necronomicon in the movie: Army of Darkness?"
SEED_PROMPT = tuple(tokenize(SEED_PROMPT_TEXT))


@dataclass(frozen=True, slots=True)
class SeedWorkload:
    """The load of the seed experiment; every field can be changed for variants."""

    requests: int = 1000
    connections: int = 100
    adapters: int = 12
    prompt: tuple[int, ...] = SEED_PROMPT
    max_tokens: int = 750
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.requests < 0 or self.connections < 1 or self.adapters < 1:
            raise ValueError("a workload needs requests >= 0, connections >= 1, adapters >= 1")
        if not self.prompt or self.max_tokens < 1 or self.timeout_s <= 0:
            raise ValueError("a workload needs a prompt, max_tokens >= 1 and a positive timeout")


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """The request being routed, as a router would see it."""

    index: int
    model: str
    prompt_tokens: int
    max_tokens: int
    started_at: float


@dataclass(frozen=True, slots=True)
class PodView:
    """One pod as a router sees it: last scraped metrics plus its own in-flight count."""

    index: int
    name: str
    waiting: int
    running: int
    kv_cache_usage: float
    running_adapters: tuple[str, ...]
    waiting_adapters: tuple[str, ...]
    max_loras: int
    metrics_age: float
    in_flight: int
    preemptions: int = 0


def pod_views(
    pods: Sequence[VirtualPod],
    sampled: Sequence[tuple[EngineSnapshot, float]],
    in_flight: Sequence[int],
    now: float,
) -> list[PodView]:
    """What a router sees of each pod at ``now``: its last scraped snapshot (taken at
    the time beside it) and the router's own in-flight count."""
    return [
        PodView(
            i,
            pods[i].name,
            snapshot.waiting,
            snapshot.running,
            snapshot.kv_cache_usage,
            snapshot.running_adapters,
            snapshot.waiting_adapters,
            snapshot.max_loras,
            now - sampled_at,
            in_flight[i],
            snapshot.preemptions,
        )
        for i, (snapshot, sampled_at) in enumerate(sampled)
    ]


RoutingFunction = Callable[[RoutedRequest, Sequence[PodView], random.Random], int]
"""Picks the index of the pod that serves a request; may draw from the given generator."""


def uniform_random(request: RoutedRequest, pods: Sequence[PodView], rng: random.Random) -> int:
    """A Kubernetes Service: every request to a pod chosen uniformly at random."""
    return rng.randrange(len(pods))


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request (times in virtual seconds from the start).

    ``output_tokens`` counts what the pod generated for it, including the part
    of a request that then timed out (which its client never gets).
    """

    index: int
    adapter: str
    started: float
    pod: int | None
    sent: float | None
    first_token: float | None
    finished: float | None
    output_tokens: int

    @property
    def completed(self) -> bool:
        return self.finished is not None


def percentile(values: Sequence[float], fraction: float) -> float:
    """Linear-interpolated percentile of ``values`` (``nan`` when empty)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class ExperimentResult:
    """The outcome of one run: per-request records and the figures derived from them.

    ``duration_s`` runs from the first request's start to the last request's end
    (completed or timed out); throughput counts the output tokens of completed
    requests only, as a client would.
    """

    records: tuple[RequestRecord, ...]
    duration_s: float

    @property
    def completed(self) -> int:
        return sum(1 for r in self.records if r.completed)

    @property
    def timed_out(self) -> int:
        return len(self.records) - self.completed

    @property
    def output_tokens(self) -> int:
        """Output tokens of completed requests: what clients received."""
        return sum(r.output_tokens for r in self.records if r.completed)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def generated_tokens_per_s(self) -> float:
        """Every token the pods generated, timed-out requests included, per second."""
        generated = sum(r.output_tokens for r in self.records)
        return generated / self.duration_s if self.duration_s > 0 else 0.0

    def ttft_s(self) -> list[float]:
        """Time to first token of completed requests, from reaching the pod."""
        return [
            r.first_token - r.sent
            for r in self.records
            if r.completed and r.first_token is not None and r.sent is not None
        ]

    def latency_s(self) -> list[float]:
        """End-to-end latency of completed requests, from their start (pool wait included)."""
        return [r.finished - r.started for r in self.records if r.finished is not None]

    def summary(self) -> str:
        ttft, latency = self.ttft_s(), self.latency_s()
        return (
            f"completed {self.completed}/{len(self.records)}, "
            f"{self.output_tokens_per_s:.0f} output tokens/s over {self.duration_s:.1f} s, "
            f"TTFT p50/p90/p99 {percentile(ttft, 0.5):.2f}/{percentile(ttft, 0.9):.2f}/"
            f"{percentile(ttft, 0.99):.2f} s, latency p50/p90/p99 "
            f"{percentile(latency, 0.5):.1f}/{percentile(latency, 0.9):.1f}/"
            f"{percentile(latency, 0.99):.1f} s"
        )


def seed_requests(
    workload: SeedWorkload, seed: int, profile: Profile = L4_LLAMA2_7B
) -> tuple[list[str], list[int]]:
    """Each request's adapter and the length of the text it writes, drawn from ``seed``:
    the same for every router, and for a live client replaying the run."""
    rng = random.Random(f"workload-{seed}")
    names = adapter_names(workload.adapters)
    adapters = [rng.choice(names) for _ in range(workload.requests)]
    lengths = [
        profile.natural_output_tokens(rng, workload.max_tokens) for _ in range(workload.requests)
    ]
    return adapters, lengths


class _Run:
    """One experiment's moving parts on one virtual loop."""

    def __init__(
        self,
        *,
        route: RoutingFunction,
        workload: SeedWorkload,
        pods: int,
        profile: Profile,
        seed: int,
        scrape_interval_s: float,
    ) -> None:
        self.route = route
        self.workload = workload
        self.scrape_interval_s = scrape_interval_s
        self.loop = VirtualLoop()
        self.pods = [
            VirtualPod(self.loop, profile, name=pod_name(i), seed=seed * 1000 + i)
            for i in range(pods)
        ]
        self.sampled = [(pod.snapshot(), 0.0) for pod in self.pods]
        self.in_flight = [0] * pods
        self.free_connections = workload.connections
        self.pending: deque[int] = deque()
        self.router_rng = random.Random(f"router-{seed}")
        count = workload.requests
        self.adapters, self.lengths = seed_requests(workload, seed, profile)
        self.started = [0.0] * count
        self.pod_of: list[int | None] = [None] * count
        self.sent: list[float | None] = [None] * count
        self.states: list[RequestState | None] = [None] * count
        self.timers: list[Timer | None] = [None] * count
        self.resolved = [False] * count
        self.finished: list[float | None] = [None] * count
        self.unresolved = count
        self.last_resolution = 0.0

    def run(self) -> ExperimentResult:
        self.loop.call_at(0.0, self._scrape)
        for index in range(self.workload.requests):
            self.loop.call_at(0.0, partial(self._start, index))
        self.loop.run()
        return ExperimentResult(self._records(), self.last_resolution)

    def _scrape(self) -> None:
        now = self.loop.now
        self.sampled = [(pod.snapshot(), now) for pod in self.pods]
        if self.unresolved:
            self.loop.call_later(self.scrape_interval_s, self._scrape)

    def _start(self, index: int) -> None:
        self.started[index] = self.loop.now
        self.timers[index] = self.loop.call_later(
            self.workload.timeout_s, partial(self._time_out, index)
        )
        self.pending.append(index)
        self._dispatch()

    def _dispatch(self) -> None:
        now = self.loop.now
        while self.free_connections and self.pending:
            index = self.pending.popleft()
            if self.resolved[index] or now >= self.started[index] + self.workload.timeout_s:
                continue
            self.free_connections -= 1
            request = RoutedRequest(
                index,
                self.adapters[index],
                len(self.workload.prompt),
                self.workload.max_tokens,
                self.started[index],
            )
            pod = self.route(request, self._views(now), self.router_rng)
            if not 0 <= pod < len(self.pods):
                raise ValueError(f"routing function chose pod {pod} of {len(self.pods)}")
            self.in_flight[pod] += 1
            self.pod_of[index] = pod
            self.sent[index] = now
            self.states[index] = self.pods[pod].submit(
                SimRequest(
                    str(index),
                    self.workload.prompt,
                    self.workload.max_tokens,
                    adapter=self.adapters[index],
                    output_length=self.lengths[index],
                    listener=self,
                )
            )

    def _views(self, now: float) -> list[PodView]:
        return pod_views(self.pods, self.sampled, self.in_flight, now)

    def on_progress(self, state: RequestState, now: float) -> None:
        if not state.finished:
            return
        index = int(state.request.request_id)
        self.finished[index] = now
        timer = self.timers[index]
        if timer is not None:
            timer.cancel()
        self._resolve(index)

    def _time_out(self, index: int) -> None:
        if self.resolved[index]:
            return
        state = self.states[index]
        pod = self.pod_of[index]
        if state is not None and pod is not None:
            self.pods[pod].abort(state)
        self._resolve(index)

    def _resolve(self, index: int) -> None:
        self.resolved[index] = True
        self.unresolved -= 1
        self.last_resolution = self.loop.now
        pod = self.pod_of[index]
        if pod is not None:
            self.in_flight[pod] -= 1
            self.free_connections += 1
            self._dispatch()

    def _records(self) -> tuple[RequestRecord, ...]:
        records = []
        for index in range(self.workload.requests):
            state = self.states[index]
            finished = self.finished[index]
            records.append(
                RequestRecord(
                    index,
                    self.adapters[index],
                    self.started[index],
                    self.pod_of[index],
                    self.sent[index],
                    state.first_token_at if state is not None else None,
                    finished,
                    state.generated if state is not None else 0,
                )
            )
        return tuple(records)


def run_experiment(
    route: RoutingFunction,
    *,
    workload: SeedWorkload | None = None,
    pods: int = 6,
    profile: Profile = L4_LLAMA2_7B,
    seed: int = 0,
    scrape_interval_s: float = 0.1,
) -> ExperimentResult:
    """Run ``workload`` (the seed experiment by default) over ``pods`` simulated pods."""
    if pods < 1:
        raise ValueError("an experiment needs at least one pod")
    if scrape_interval_s <= 0:
        raise ValueError("the scrape interval must be positive")
    run = _Run(
        route=route,
        workload=workload or SeedWorkload(),
        pods=pods,
        profile=profile,
        seed=seed,
        scrape_interval_s=scrape_interval_s,
    )
    return run.run()
