"""Two ``policyd serve`` replicas behind one Envoy cluster, one killed under load.

The stack: one ``policyd sim`` process with four simulated vLLM pods, two
``policyd serve`` processes (``rules/lora-balanced.yaml``, the same pods file,
each its own port and decision log), and one Envoy whose ``policyd`` cluster
lists both (``policyd envoy-config --policyd-addresses``), each host gRPC
health-checked on its own.

The kill: a fixed rate of short completions over adapters, and some streamed
generations that are mid-stream when replica 0 gets SIGKILL. What it costs,
and why (measured: see ``test_a_killed_replica_costs_only_the_requests_it_held``):

- Generations already streaming go on. Their ext_proc streams die with the
  replica, but ext_proc fails open (``failure_mode_allow``): Envoy stops
  asking policyd and passes the rest of the response through. The pod was
  chosen long before, so nothing is lost.
- Requests Envoy hands the dead replica before its health check ejects it
  (two failed checks, 2 s apart) fail: the ext_proc stream cannot connect,
  Envoy carries on without a routing reply, so the request has no
  destination header and matches only the ``unrouted`` route, the JSON 503
  ``no_destination``. So do requests the replica held before it answered
  their routing (a few milliseconds each).
- Every request the surviving replica routed succeeds (its decision log names
  each by its trace id), and once Envoy marks the dead host unhealthy
  every new request goes to the survivor and succeeds.

The second test: both replicas, in processes with different hash seeds, send
each adapter to the same home pod (the ``rendezvous`` scorer hashes with
BLAKE2b, not the per-process ``hash``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from e2e_rig import until_serving

from policyd.extproc.envoy_config import EnvoyConfigOptions
from policyd.extproc.envoy_process import EnvoyProcess, free_port, start_envoy
from policyd.policy.kinds.rendezvous import rendezvous_weight

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

REPO = Path(__file__).resolve().parents[2]
POLICYD = [sys.executable, "-m", "policyd"]
PODS = 4
ADAPTERS = 12  # policyd sim's default: adapter-0..adapter-11
RATE = 40.0  # short requests a second, sent on a clock whatever the answers
DURATION = 9.0  # at least; on until the ejection was seen and AFTER requests followed it
AFTER = 20
KILL_AT = 3.0
DEADLINE = 60.0  # seconds the ejection may take on a loaded machine before the test fails
STREAMS = 8  # streamed generations started before the kill, still running at it
STREAM_TOKENS = 1500


def trace_id(request: str) -> str:
    return request.encode().hex().rjust(32, "0")


@dataclass
class Replica:
    port: int
    process: subprocess.Popen[str]
    decision_log: Path

    def routed(self) -> dict[str, dict[str, Any]]:
        """The decisions this replica logged, by the request's id (``Sent.id``)."""
        lines = self.decision_log.read_text().splitlines() if self.decision_log.exists() else []
        entries = map(json.loads, lines)
        return {bytes.fromhex(e["trace_id"]).lstrip(b"\0").decode(): e for e in entries}


@dataclass
class Stack:
    pods: dict[str, str]
    replicas: list[Replica]
    envoy: EnvoyProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listen_port}"


@asynccontextmanager
async def replicas_stack(tmp: Path) -> AsyncIterator[Stack]:
    """The pods, two replicas and Envoy; everything stopped on the way out."""
    processes: list[subprocess.Popen[str]] = []
    envoy: EnvoyProcess | None = None
    try:
        sim = subprocess.Popen(
            [*POLICYD, "sim", f"--pods={PODS}", "--base-port=0", "--time-scale=10"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        processes.append(sim)
        assert sim.stdout is not None
        lines = [await asyncio.to_thread(sim.stdout.readline) for _ in range(PODS + 1)]
        pods = dict(line.strip().split(" http://") for line in lines[1:])
        pods_file = tmp / "pods.yaml"
        pods_file.write_text(
            "pods:\n" + "".join(f"  - {{name: {n}, address: '{a}'}}\n" for n, a in pods.items())
        )
        replicas = []
        for index in range(2):
            port = free_port()
            log = tmp / f"decisions-{index}.jsonl"
            command = [
                *POLICYD, "serve", "--policy", str(REPO / "rules" / "lora-balanced.yaml"),
                "--pods", str(pods_file), "--port", str(port),
                # Every pod stays a candidate while a loaded machine misses scrapes:
                # these tests are about the replicas, not about scraping.
                "--scrape-interval", "0.1", "--scrape-timeout", "0.1", "--stale-after", "30",
                "--include-stale",
                "--monitoring-port", "0", "--grace-seconds", "2", "--decision-log", str(log),
                "--log-level", "warning",
            ]  # fmt: skip
            # Different hash seeds: nothing the replicas must agree on may use hash().
            env = {**os.environ, "PYTHONHASHSEED": str(index + 1)}
            process = subprocess.Popen(command, stderr=subprocess.DEVNULL, text=True, env=env)
            processes.append(process)
            replicas.append(Replica(port, process, log))
        for replica in replicas:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{replica.port}") as channel:
                await until_serving(channel, replica.process)
        options = EnvoyConfigOptions(
            port=0,
            admin_port=0,
            policyd_addresses=tuple(f"127.0.0.1:{r.port}" for r in replicas),
        )
        envoy = await start_envoy(tmp, options)
        stack = Stack(pods, replicas, envoy)
        async with aiohttp.ClientSession() as client:
            await until_hosts_healthy(client, stack, 2)
        yield stack
    finally:
        if envoy is not None:
            envoy.stop()
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


async def host_flags(client: aiohttp.ClientSession, stack: Stack) -> dict[int, str]:
    """Envoy's health flags for each policyd host, by port (``healthy`` or what failed)."""
    async with client.get(f"http://127.0.0.1:{stack.envoy.admin_port}/clusters") as response:
        text = await response.text()
    flags = {}
    for line in text.splitlines():
        name, _, rest = line.partition("::")
        host, _, flag = rest.partition("::health_flags::")
        if name == "policyd" and flag:
            flags[int(host.rpartition(":")[2])] = flag
    return flags


async def until_hosts_healthy(client: aiohttp.ClientSession, stack: Stack, count: int) -> None:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        if list((await host_flags(client, stack)).values()).count("healthy") == count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"Envoy did not see {count} healthy policyd hosts")


@dataclass
class Sent:
    id: str
    started: float
    stream: bool = False
    status: int = 0  # 0: the connection failed or was cut
    code: str = ""  # the error code of a JSON error body
    streaming_at: float = 0.0  # when the first chunk arrived
    ended: float = 0.0
    done: bool = False  # a stream that ended with data: [DONE]
    detail: str = ""


async def send(client: aiohttp.ClientSession, url: str, record: Sent, model: str) -> None:
    body = {
        "model": model,
        "prompt": f"request {record.id}",
        "max_tokens": STREAM_TOKENS if record.stream else 4,
        "stream": record.stream,
    }
    # Envoy replaces a client's x-request-id at the edge, but passes a traceparent
    # on (it traces nothing here): its trace id names the request in decision logs.
    headers = {"traceparent": f"00-{trace_id(record.id)}-{'1' * 16}-01"}
    try:
        async with client.post(url + "/v1/completions", json=body, headers=headers) as response:
            if record.stream and response.status == 200:
                tail = b""
                async for chunk in response.content.iter_any():
                    record.streaming_at = record.streaming_at or time.monotonic()
                    tail = (tail + chunk)[-64:]
                record.done = b"data: [DONE]" in tail
            else:
                text = await response.text()
                if response.status != 200:
                    record.detail = text[:200]
                    record.code = json.loads(text)["error"]["code"]
            record.status = response.status
    except (aiohttp.ClientError, ValueError, KeyError) as error:
        record.detail = record.detail or type(error).__name__
    record.ended = time.monotonic()


@dataclass
class Run:
    sent: list[Sent] = field(default_factory=list)
    killed_at: float = 0.0
    ejected_at: float = 0.0

    def failed(self) -> list[Sent]:
        return [s for s in self.sent if s.status != 200 or (s.stream and not s.done)]

    def summary(self, survivor: set[str]) -> str:
        streams = [s for s in self.sent if s.stream]
        across = [s for s in streams if s.streaming_at and s.streaming_at < self.killed_at]
        kinds = Counter(f"{s.status} {s.code or s.detail}" for s in self.failed())
        window = [s for s in self.sent if self.killed_at <= s.started < self.ejected_at]
        return (
            f"{len(self.sent)} sent ({len(streams)} streamed, {len(across)} streaming at the "
            f"kill), {len(self.failed())} failed {dict(kinds)}; ejected "
            f"{self.ejected_at - self.killed_at:.2f} s after the kill, {len(window)} sent in "
            f"between; the survivor routed {len(survivor)}"
        )


async def test_a_killed_replica_costs_only_the_requests_it_held(tmp_path: Path) -> None:
    run = Run()
    async with replicas_stack(tmp_path) as stack:
        victim, survivor = stack.replicas
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
            for index in range(ADAPTERS):  # every adapter on a pod, as under steady load
                warm = Sent(f"warm-{index}", time.monotonic())
                await send(client, stack.url, warm, f"adapter-{index}")
                assert warm.status == 200, warm.detail

            async def watch_ejection() -> None:
                while not run.killed_at:
                    await asyncio.sleep(0.01)
                while (await host_flags(client, stack)).get(victim.port) == "healthy":
                    await asyncio.sleep(0.02)
                run.ejected_at = time.monotonic()

            def sending() -> bool:
                """On for DURATION, and until AFTER requests followed the ejection."""
                if time.monotonic() - start > DEADLINE:
                    return False  # the ejection never came: the checks below fail
                after = [s for s in run.sent if run.ejected_at and s.started > run.ejected_at]
                return time.monotonic() - start < DURATION or len(after) < AFTER

            watcher = asyncio.create_task(watch_ejection())
            tasks: list[asyncio.Task[None]] = []
            start = time.monotonic()
            stream_every = int(RATE * (KILL_AT - 1.0) / STREAMS)
            index = 0
            while sending():
                delay = start + index / RATE - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if not run.killed_at and time.monotonic() - start >= KILL_AT:
                    victim.process.send_signal(signal.SIGKILL)
                    run.killed_at = time.monotonic()
                stream = index % stream_every == 0 and index < STREAMS * stream_every
                record = Sent(f"r{index}", time.monotonic(), stream=stream)
                run.sent.append(record)
                model = f"adapter-{index % ADAPTERS}"
                tasks.append(asyncio.create_task(send(client, stack.url, record, model)))
                index += 1
            await asyncio.gather(*tasks)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            assert run.ejected_at, f"Envoy did not eject the killed replica in {DEADLINE:.0f} s"
            # Envoy's health check keeps the dead host out; the survivor serves on.
            after = Sent("after", time.monotonic())
            await send(client, stack.url, after, "adapter-0")
            assert after.status == 200, after.detail
        survivor.process.send_signal(signal.SIGTERM)  # flushes its decision log
        await asyncio.to_thread(survivor.process.wait, 20)
        routed_by_survivor = set(survivor.routed())

    report = run.summary(routed_by_survivor)
    print("\n" + report)
    failed = run.failed()
    # Streams that were streaming when their replica died went on to the end.
    streams = [s for s in run.sent if s.stream]
    assert len(streams) == STREAMS, report
    across = [s for s in streams if s.streaming_at and s.streaming_at < run.killed_at]
    assert [s for s in across if s.ended > run.killed_at], report  # really across the kill
    assert all(s.status == 200 and s.done for s in streams), report
    # What failed was refused routing (no destination), not cut, and never one
    # the survivor routed: the victim held it (Envoy had handed it the request).
    assert all((s.status, s.code) == (503, "no_destination") for s in failed), report
    assert not {s.id for s in failed} & routed_by_survivor, report
    # Only requests in flight at the kill or sent before the ejection was seen.
    assert all(s.ended >= run.killed_at and s.started <= run.ejected_at for s in failed), report
    # Every request the survivor routed, and every one sent after the ejection, succeeded.
    ok = {s.id for s in run.sent if s not in failed}
    assert {s.id for s in run.sent} & routed_by_survivor <= ok, report
    late = {s.id for s in run.sent if s.started > run.ejected_at}
    assert len(late) >= AFTER and late <= ok, report
    # The survivor took over: it routed the requests sent after the ejection.
    assert late <= routed_by_survivor, report


def home(adapter: str, pods: dict[str, str]) -> str:
    """The adapter's home: the pod with the highest rendezvous weight."""
    return max(pods, key=lambda pod: rendezvous_weight(adapter, pod))


def neutral(entry: dict[str, Any]) -> bool:
    """Whether the decision saw every pod, all alike but for its name: then only the
    adapter's home sets them apart. (A scrape that caught the request before
    still running, or its in-flight count not yet given back, as a loaded
    machine makes likely, may rightly pull a request elsewhere.)"""
    fields = ("waiting_queue", "running", "kv_cache", "max_loras")
    seen = {
        (
            *(pod[field] for field in fields),
            *(tuple(sorted(pod[field])) for field in ("active_loras", "waiting_loras")),
            pod["in_flight"] - (pod["name"] == entry["pod"]),  # logged with this request
        )
        for pod in entry["pods"]
    }
    return len(entry["pods"]) == PODS and len(seen) == 1


async def test_both_replicas_send_each_adapter_to_the_same_home(tmp_path: Path) -> None:
    """Sequential requests on idle pods, each adapter several times: Envoy spreads them
    over both replicas, and both pick the adapter's home whenever the pods look alike."""
    async with replicas_stack(tmp_path) as stack:
        async with aiohttp.ClientSession() as client:
            for round_ in range(4):  # twice in a row: Envoy alternates the replicas
                for index in sorted(list(range(ADAPTERS)) * 2):
                    record = Sent(f"a{index}-{round_}", time.monotonic())
                    await send(client, stack.url, record, f"adapter-{index}")
                    assert record.status == 200, record.detail
        for replica in stack.replicas:
            replica.process.send_signal(signal.SIGTERM)  # flushes the decision logs
            await asyncio.to_thread(replica.process.wait, 20)
        decisions = [list(replica.routed().values()) for replica in stack.replicas]
    expected = {f"adapter-{i}": home(f"adapter-{i}", stack.pods) for i in range(ADAPTERS)}
    picks = [
        {(entry["request"]["target_model"], entry["pod"]) for entry in logged if neutral(entry)}
        for logged in decisions
    ]
    alike = [sum(map(neutral, logged)) for logged in decisions]
    print(f"\npods alike in {alike} of {[len(logged) for logged in decisions]} decisions")
    assert all(picks), picks  # each replica routed some alike-looking pods
    for pick in picks:
        assert {model: pod for model, pod in pick} == {m: expected[m] for m, _ in pick}
        assert len({model for model, _ in pick}) == len(pick)  # one pod per adapter
    adapters = [{model for model, _ in pick} for pick in picks]
    assert adapters[0] & adapters[1], adapters  # the two agree on adapters they both routed
