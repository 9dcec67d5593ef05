"""Hot reload through the whole path: the policy file changes while traffic flows.

policyd polls the file (every 0.1 s here); a version that does not load is
rejected with its place in the file and the old one keeps routing; one that
loads routes the next requests, while streams already routed finish on the
pods they were sent to.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from e2e_rig import (
    PolicydGateway,
    settled,
    start_policyd_gateway,
    stop_policyd_gateway,
    until,
)
from e2e_support import RecordedSpan

from policyd.extproc.envoy_process import free_port
from policyd.policy import store as store_module

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

REPO = Path(__file__).resolve().parents[2]
SEED = (REPO / "rules" / "default.yaml").read_text()
TEST_ID = "x-test-id"
PINNED = """\
name: pinned
description: every request to vllm-1
filters:
  only vllm-1:
    keep: pod.name == "vllm-1"
"""


@pytest_asyncio.fixture(loop_scope="module")
async def gateway(tmp_path: Path) -> AsyncIterator[PolicydGateway]:
    policy = tmp_path / "live.yaml"
    policy.write_text(SEED)
    # Time runs only twice as fast here: a stream of 50+ tokens lasts over 1.5 s.
    rig = await start_policyd_gateway(tmp_path, policy, time_scale=2.0)
    try:
        yield rig
    finally:
        await stop_policyd_gateway(rig)


def span(gateway: PolicydGateway, test_id: str) -> RecordedSpan:
    found = [
        s for s in gateway.telemetry.spans.values() if s.request.headers.get(TEST_ID) == test_id
    ]
    assert len(found) == 1
    return found[0]


async def complete(gateway: PolicydGateway, test_id: str) -> tuple[int, dict[str, Any]]:
    body = {"model": "adapter-2", "prompt": "p", "max_tokens": 4}
    async with gateway.client.post(
        gateway.url + "/v1/completions", json=body, headers={TEST_ID: test_id}
    ) as response:
        return response.status, await response.json()


async def replace_policy(gateway: PolicydGateway, text: str) -> None:
    """Swap in a whole new policy file and wait until policyd has polled it.

    The new text goes to a sibling file first and is renamed over the old one,
    as a deploy tool does, so policyd never reads it half-written.
    """
    seen = len(gateway.reloads)
    staged = gateway.policy_path.with_suffix(".staged")
    staged.write_text(text)
    staged.replace(gateway.policy_path)
    await until(lambda: len(gateway.reloads) > seen, "policyd to poll the changed policy")


async def test_a_policy_that_does_not_load_is_rejected_and_the_old_one_keeps_routing(
    gateway: PolicydGateway,
) -> None:
    version = gateway.service.store.current.version
    line = SEED.splitlines().index("  low queueing:") + 2
    await replace_policy(gateway, SEED.replace("pod.waiting_queue <", "pod.waiting_qeue <", 1))
    rejected = gateway.reloads[-1]
    assert rejected.error is not None
    assert f"live.yaml:{line}:" in str(rejected.error)
    assert "waiting_qeue" in str(rejected.error)
    assert gateway.service.store.current.version == version
    status, body = await complete(gateway, "after-bad")
    assert status == 200, body
    decision = span(gateway, "after-bad").decision
    assert (decision.policy, decision.policy_version) == ("default", version)


async def test_a_new_policy_routes_the_next_requests_and_open_streams_finish(
    gateway: PolicydGateway,
) -> None:
    streams = [
        await gateway.client.post(
            gateway.url + "/v1/completions",
            json={
                "model": f"adapter-{i}",
                "prompt": "tell a long story",
                "max_tokens": 60,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            headers={TEST_ID: f"stream-{i}"},
        )
        for i in range(6)
    ]
    try:
        for stream in streams:
            assert stream.status == 200
            assert (await stream.content.readuntil(b"\n\n")).startswith(b"data: ")
        old = {f"stream-{i}": span(gateway, f"stream-{i}") for i in range(6)}
        assert {s.decision.policy for s in old.values()} == {"default"}

        await replace_policy(gateway, PINNED)
        assert gateway.reloads[-1].changed
        assert all(s.end_calls == 0 for s in old.values())  # still streaming

        before = gateway.served()["vllm-1"]
        answers = await asyncio.gather(*(complete(gateway, f"new-{i}") for i in range(6)))
        assert [status for status, _ in answers] == [200] * 6
        assert {span(gateway, f"new-{i}").decision.pod for i in range(6)} == {"vllm-1"}
        assert {span(gateway, f"new-{i}").decision.policy for i in range(6)} == {"pinned"}

        for stream in streams:
            events = (await stream.content.read()).split(b"\n\n")
            assert events[-2:] == [b"data: [DONE]", b""]
            usage = json.loads(events[-3].removeprefix(b"data: "))["usage"]
            assert usage["completion_tokens"] >= 50
        await settled(gateway.service.server)
        for recorded in old.values():
            assert recorded.ended["completed"] is True
            assert recorded.ended["completion_tokens"] >= 50
        # Six new requests on vllm-1, plus the streams the old policy had sent there.
        streamed_there = sum(s.decision.pod == "vllm-1" for s in old.values())
        assert gateway.served()["vllm-1"] == before + 6 + streamed_there
    finally:
        for stream in streams:
            stream.release()


class Clock:
    """The policy store's ``time``, moved by the test: settling counts these seconds only."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


async def test_a_bad_byte_a_cut_file_or_one_still_being_written_never_replaces_the_policy(
    gateway: PolicydGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guards ``policyd serve`` turns on: a NUL byte is rejected at its place, a file
    cut before ``filters:`` is refused, one caught mid-number is never loaded, and the
    watcher goes on to load the next good version."""
    store = gateway.service.store
    store.settle_seconds = 1.0
    store.refuse_new_warnings = True
    version = store.current.version
    policy = gateway.policy_path

    nul = SEED.index("filters:")
    await replace_policy(gateway, SEED[:nul] + "\0" + SEED[nul + 1 :])
    rejected = gateway.reloads[-1]
    line = SEED[:nul].count("\n") + 1
    assert str(rejected.error) == (
        f"{policy}:{line}:1: invalid YAML: character U+0000 (NUL) is not allowed; "
        "is the file complete, and text?"
    )

    await replace_policy(gateway, SEED[:nul])  # cut before filters: loads, but refused
    refused = gateway.reloads[-1]
    assert refused.error is not None and not refused.changed
    assert "reload refused" in str(refused.error)
    assert "filter nodes and now has none: is the file complete?" in str(refused.error)
    assert store.current.version == version
    status, body = await complete(gateway, "after-cut")
    assert status == 200, body
    assert span(gateway, "after-cut").decision.policy_version == version

    store.refuse_new_warnings = False  # only the settle interval keeps the next one out
    clock = Clock()  # settling by the test's clock: a loaded machine cannot stretch it
    monkeypatch.setattr(store_module, "time", clock)
    looks = 0
    poll = store.poll

    def counted(now: float | None = None) -> Any:
        nonlocal looks
        try:
            return poll(now)
        finally:
            looks += 1

    async def two_looks() -> None:  # the second began after this call
        target = looks + 2
        await until(lambda: looks >= target, "two looks of the watcher")

    monkeypatch.setattr(store, "poll", counted)
    seen = len(gateway.reloads)
    number = re.search(r"value: \d\d", SEED)  # cut after its first digit
    assert number is not None
    cut = number.end() - 1
    policy.write_text(SEED[:cut])  # the writer is still at it
    await two_looks()  # the fragment settles from now
    clock.now += 0.6
    await two_looks()
    edited = SEED.replace("\ndescription: ", "\ndescription: edited. ", 1)
    policy.write_text(edited)
    await two_looks()
    clock.now += 0.6  # the fragment would have settled by now, the finished file has not
    await two_looks()
    assert len(gateway.reloads) == seen
    clock.now += 0.6
    await until(lambda: len(gateway.reloads) > seen, "policyd to load the finished file")
    await two_looks()
    assert len(gateway.reloads) == seen + 1  # the fragment was never loaded, nor rejected
    assert gateway.reloads[-1].changed
    (loaded,) = store.current.policies
    assert loaded.description.startswith("edited. ")
    status, body = await complete(gateway, "after-edit")
    assert status == 200, body
    assert span(gateway, "after-edit").decision.policy_version == loaded.version


async def test_serve_logs_every_reload_and_stops_cleanly_after_a_bad_byte(tmp_path: Path) -> None:
    """``policyd serve`` as operators run it: the warnings of the policy at start and
    of each reload are logged, a NUL byte and a cut file are rejected in the log, the
    next good edit loads, and SIGTERM still exits 0 without a traceback."""
    policy = tmp_path / "live.yaml"
    spare = "params:\n  spare: {type: int, value: 1}\n"
    start = SEED.replace("params:\n", spare, 1)
    policy.write_text(start)
    pods = tmp_path / "pods.yaml"
    pods.write_text(f"pods:\n  - {{name: vllm-0, address: '127.0.0.1:{free_port()}'}}\n")
    command = [
        sys.executable, "-m", "policyd", "serve", "--policy", str(policy), "--pods", str(pods),
        "--port", str(free_port()), "--monitoring-port", "0", "--log-format", "json",
        "--policy-poll-interval", "0.05", "--policy-settle-seconds", "0.2",
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE)
    assert process.stderr is not None
    stderr = process.stderr
    events: list[dict[str, Any]] = []

    async def logged(level: str, text: str) -> dict[str, Any]:
        """The first event (so far, or from now on) at ``level`` containing ``text``."""
        try:
            async with asyncio.timeout(20):
                while True:
                    for event in events:
                        if event["level"] == level and text in event["message"]:
                            events.remove(event)
                            return event
                    line = await stderr.readline()
                    assert line, f"policyd serve exited before logging {text!r}"
                    events.append(json.loads(line))
        except TimeoutError:
            raise AssertionError(f"no {level} {text!r} logged; unclaimed: {events}") from None

    spare_line = start[: start.index("  spare:")].count("\n") + 1
    warning = f"live.yaml:{spare_line}:3: warning: param 'spare' is never used"
    try:
        await logged("warning", warning)  # at start
        await logged("info", "serving policy")
        nul = start.index("filters:")
        policy.write_text(start[:nul] + "\0" + start[nul + 1 :])
        line = start[:nul].count("\n") + 1
        rejected = await logged("error", "policy change rejected")
        assert f"live.yaml:{line}:1: invalid YAML: character U+0000 (NUL)" in rejected["message"]
        policy.write_text(start[:nul])
        refused = await logged("error", "policy change rejected")
        assert "reload refused" in refused["message"]
        assert "filter nodes and now has none: is the file complete?" in refused["message"]
        policy.write_text(start.replace("\ndescription: ", "\ndescription: edited. ", 1))
        await logged("info", "now serving")
        await logged("warning", warning)  # the loaded version's warnings, again
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            rest = (await stderr.read()).decode()
            code = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert code == 0, rest
    assert "Traceback" not in rest
    assert not [e for e in events if e["level"] == "error"]
