"""Swapping policies: atomic, and a bad file never replaces a good one."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from policyd.policy import PolicyError, PolicyStore, Reload, Router

from .helpers import pod, request, write

PODS = [pod("a", waiting_queue=1), pod("b", waiting_queue=9)]
SHORT = "name: live\nfilters:\n  short:\n    keep: pod.waiting_queue < 5\n"
LONG = "name: live\nfilters:\n  long:\n    keep: pod.waiting_queue > 5\n"
BROKEN = "name: live\nfilters:\n  long:\n    keep: pod.waiting_qeue > 5\n"


def test_reload_swaps_in_a_changed_policy(tmp_path: Path) -> None:
    path = write(tmp_path, SHORT)
    store = PolicyStore.open(path)
    router = Router(store)
    first = store.current.version
    assert router.decide(request(), PODS).pod == "a"
    assert store.reload().changed is False  # nothing changed on disk
    write(tmp_path, LONG)
    result = store.reload()
    assert result.changed and result.error is None
    assert store.current.version != first
    decision = router.decide(request(), PODS)
    assert decision.pod == "b"
    assert decision.policy_version == store.current.version


def test_a_bad_file_is_rejected_with_its_reason_and_the_old_policy_keeps_serving(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, SHORT)
    store = PolicyStore.open(path)
    router = Router(store)
    serving = store.current
    write(tmp_path, BROKEN)
    result = store.reload()
    assert result.changed is False
    assert result.error is not None
    assert [str(d) for d in result.error.errors] == [
        f"{path}:4:14: undefined field 'waiting_qeue' not found in struct 'policyd.Pod'; "
        "did you mean 'waiting_queue'?"
    ]
    assert store.current is serving
    assert router.decide(request(), PODS).pod == "a"
    assert store.reload().error is None  # the same broken content is reported once
    write(tmp_path, LONG)
    assert store.reload().changed
    assert router.decide(request(), PODS).pod == "b"


def test_opening_a_bad_file_raises_with_every_reason(tmp_path: Path) -> None:
    path = write(tmp_path, BROKEN)
    with pytest.raises(PolicyError, match="waiting_qeue"):
        PolicyStore.open(path)


async def test_watch_swaps_changes_off_the_event_loop_and_reports_them(tmp_path: Path) -> None:
    path = write(tmp_path, SHORT)
    store = PolicyStore.open(path)
    router = Router(store)
    reports: list[Reload] = []
    task = asyncio.create_task(store.watch(interval=0.01, on_reload=reports.append))
    try:
        write(tmp_path, BROKEN)
        await _until(lambda: len(reports) == 1)
        assert reports[0].error is not None
        assert router.decide(request(), PODS).pod == "a"
        write(tmp_path, LONG)
        await _until(lambda: len(reports) == 2)
        assert reports[1].changed and reports[1].error is None
        assert router.decide(request(), PODS).pod == "b"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def _until(condition: object, timeout: float = 5.0) -> None:
    async def wait() -> None:
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.005)

    await asyncio.wait_for(wait(), timeout)


def test_decisions_during_swaps_each_see_one_whole_policy(tmp_path: Path) -> None:
    """A swapping thread flips between two policies while decisions run."""
    one = PolicyStore.open(write(tmp_path, SHORT, "short.yaml")).current
    other = PolicyStore.open(write(tmp_path, LONG, "long.yaml")).current
    store = PolicyStore(one)
    router = Router(store)
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            store.swap(other)
            store.swap(one)

    swapper = threading.Thread(target=swap)
    swapper.start()
    seen: set[str] = set()
    expected = {one.version: (("short",), "a"), other.version: (("long",), "b")}
    decisions = 0
    deadline = time.monotonic() + 20
    try:
        # At least 3000 decisions, and on until both policies were seen: how
        # often the threads interleave is up to the interpreter's scheduler.
        while decisions < 3000 or (len(seen) < 2 and time.monotonic() < deadline):
            decision = router.decide(request(), PODS)
            nodes = tuple(t.node for t in decision.trace)
            assert (nodes, decision.pod) == expected[decision.policy_version]
            seen.add(decision.policy_version)
            decisions += 1
    finally:
        stop.set()
        swapper.join(timeout=5)
    assert seen == {one.version, other.version}
