"""Swapping policies: atomic, and a bad file never replaces a good one."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from policyd.policy import PolicyError, PolicySet, PolicyStore, Reload, Router
from policyd.policy import store as store_module
from policyd.policy.loader import load_policy_set

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


async def _until(condition: object, timeout: float = 30.0) -> None:
    """Wait for ``condition``; the generous bound fails only what never happens."""

    async def wait() -> None:
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.005)

    await asyncio.wait_for(wait(), timeout)


class _Looks:
    """Counts the watcher's finished looks (its ``poll`` calls), to wait on instead of sleeping."""

    def __init__(self, store: PolicyStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = store.poll

        def poll(now: float | None = None) -> Reload | None:
            try:
                return real(now)
            finally:
                self.count += 1

        monkeypatch.setattr(store, "poll", poll)

    async def more(self, looks: int) -> None:
        """Wait for ``looks`` more looks: all but the first began after this call."""
        target = self.count + looks
        await _until(lambda: self.count >= target)


class _Clock:
    """The store's ``time``, moved by the test: settling counts these seconds only."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


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


# -- a reload never silently stops, nor loads a fragment (issue 23, item 4) ---------------

GUARDED = """\
name: live
params:
  max_queue: {type: int, value: 50}
filters:
  short:
    keep: pod.waiting_queue < params.max_queue
    on_failure: busy
  busy:
    shed: every pod is busy
"""


def _outcome(store: PolicyStore, waiting_queue: int = 20) -> str:
    return Router(store).decide(request(), [pod("a", waiting_queue=waiting_queue)]).outcome.value


def test_a_change_loads_only_once_the_file_stopped_changing(tmp_path: Path) -> None:
    """A file caught mid-number (``value: 5`` of ``value: 50``) is valid, but never served."""
    path = write(tmp_path, GUARDED)
    store = PolicyStore.open(path, settle_seconds=1.0)
    serving = store.current
    path.write_text(GUARDED.replace("value: 50", "value: 5"))  # the writer is still at it
    assert store.poll(now=100.0) is None
    assert store.poll(now=100.4) is None
    path.write_text(GUARDED.replace("every pod is busy", "all busy"))  # done
    assert store.poll(now=100.6) is None  # changed again since 100.0: start over
    assert store.poll(now=101.5) is None  # stable for 0.9 s only
    assert store.current is serving
    result = store.poll(now=101.7)
    assert result is not None and result.changed and result.error is None
    assert _outcome(store) == "routed"  # 20 < 50: not the fragment's 5
    assert Router(store).decide(request(), [pod("a", waiting_queue=60)]).reason == "all busy"
    assert store.poll(now=103.0) is None  # loaded: nothing new


def test_a_load_during_which_the_file_changed_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, GUARDED)
    store = PolicyStore.open(path, settle_seconds=1.0)
    serving = store.current
    path.write_text(GUARDED.replace("value: 50", "value: 5"))
    real = load_policy_set

    def load_while_written(where: Path) -> PolicySet:
        loaded = real(where)
        path.write_text(GUARDED.replace("value: 50", "value: 51"))  # mid-write, after reading
        return loaded

    monkeypatch.setattr(store_module, "load_policy_set", load_while_written)
    assert store.poll(now=0.0) is None
    assert store.poll(now=1.5) is None  # loaded "5", but the file moved on: not swapped
    assert store.current is serving
    monkeypatch.setattr(store_module, "load_policy_set", real)
    assert store.poll(now=2.0) is None  # "51" settles from 1.5 on
    result = store.poll(now=2.6)
    assert result is not None and result.changed
    assert Router(store).decide(request(), [pod("a", waiting_queue=50)]).outcome.value == "routed"


async def test_the_watcher_waits_for_a_file_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, GUARDED)
    store = PolicyStore.open(path, settle_seconds=1.0)
    clock = _Clock()
    monkeypatch.setattr(store_module, "time", clock)  # the watcher's clock, not the event loop's
    looks = _Looks(store, monkeypatch)
    reports: list[Reload] = []
    task = asyncio.create_task(store.watch(interval=0.02, on_reload=reports.append))
    try:
        half = GUARDED.index("    on_failure")
        path.write_text(GUARDED[:half].replace("value: 50", "value: 5"))
        await looks.more(2)  # the fragment is seen: it settles from now
        clock.now += 0.6
        await looks.more(2)
        path.write_text(GUARDED.replace("every pod is busy", "all busy"))  # the writer is done
        await looks.more(2)
        clock.now += 0.6  # the fragment would have settled by now, the whole file has not
        await looks.more(2)
        assert reports == []
        clock.now += 0.6
        await _until(lambda: len(reports) == 1)
        await looks.more(2)
        assert len(reports) == 1  # the fragment was never loaded, nor rejected
        assert reports[0].changed
        assert _outcome(store) == "routed"
        assert Router(store).decide(request(), [pod("a", waiting_queue=60)]).reason == "all busy"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


CUT_BEFORE_FILTERS = GUARDED[: GUARDED.index("filters:")]


def test_a_file_cut_before_filters_is_refused_and_loads_only_when_accepted(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, GUARDED)
    store = PolicyStore.open(path, refuse_new_warnings=True)
    serving = store.current
    path.write_text(CUT_BEFORE_FILTERS)  # loads on its own: no filters, an unused param
    result = store.reload()
    assert not result.changed and result.current is serving and store.current is serving
    assert result.error is not None
    assert [str(d) for d in result.error.errors] == [
        f"{path}:1:1: reload refused: 3 warnings that the policy serving now does not have "
        "(listed here); fix the file, or let reloads accept new warnings "
        "(policyd serve --accept-policy-warnings)"
    ]
    assert [str(d) for d in result.error.diagnostics if d.severity == "warning"] == [
        f"{path}:1:7: warning: policy 'live' had 1 shed node and now has none: "
        "is the file complete?",
        f"{path}:1:7: warning: policy 'live' had 2 filter nodes and now has none: "
        "is the file complete?",
        f"{path}:3:3: warning: param 'max_queue' is never used",
    ]
    assert _outcome(store, waiting_queue=60) == "shed"
    assert store.reload().error is None  # reported once

    store.refuse_new_warnings = False  # the operator's opt-in
    path.write_text(CUT_BEFORE_FILTERS + "\n")
    accepted = store.reload()
    assert accepted.changed and accepted.error is None
    assert _outcome(store, waiting_queue=60) == "routed"  # what the operator asked for
    assert [d.message for d in accepted.warnings] == [
        "policy 'live' had 1 shed node and now has none: is the file complete?",
        "policy 'live' had 2 filter nodes and now has none: is the file complete?",
        "param 'max_queue' is never used",
    ]
    assert _outcome(store) == "routed"


def test_a_new_warning_is_refused_one_the_policy_had_already_is_not(tmp_path: Path) -> None:
    path = write(tmp_path, SHORT)
    store = PolicyStore.open(path, refuse_new_warnings=True)
    unused = SHORT.replace("filters:", "params:\n  spare: {type: int, value: 1}\nfilters:")
    path.write_text(unused)
    refused = store.reload()
    assert refused.error is not None and not refused.changed
    assert [str(d) for d in refused.error.diagnostics if d.severity == "warning"] == [
        f"{path}:3:3: warning: param 'spare' is never used"
    ]
    assert store.current.policies[0].warnings == ()

    store.refuse_new_warnings = False
    path.write_text(unused + "\n")
    assert store.reload().changed  # accepted: the policy serving now has this warning
    store.refuse_new_warnings = True
    path.write_text("# moved down a line\n" + unused)
    moved = store.reload()
    assert moved.changed and moved.error is None  # the same warning, not a new one
    assert [str(d) for d in moved.warnings] == [f"{path}:4:3: warning: param 'spare' is never used"]


def test_warnings_of_a_loaded_change_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, SHORT)
    store = PolicyStore.open(path)
    path.write_text(SHORT.replace("filters:", "params:\n  spare: {type: int, value: 1}\nfilters:"))

    async def one_look() -> None:
        task = asyncio.create_task(store.watch(interval=0.01))
        await _until(lambda: any(r.levelname == "WARNING" for r in caplog.records))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger="policyd.policy.store"):
        asyncio.run(one_look())
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", f"policy {store.current.version} now serving"),
        ("WARNING", f"policy: {path}:3:3: warning: param 'spare' is never used"),
    ]


async def test_a_nul_byte_is_rejected_at_its_place_and_the_watcher_goes_on(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, SHORT)
    store = PolicyStore.open(path)
    reports: list[Reload] = []
    task = asyncio.create_task(store.watch(interval=0.01, on_reload=reports.append))
    try:
        for count, bad in enumerate((b"name: live\nfil\x00\x00\x00", b"name: live\x07\n"), 1):
            path.write_bytes(bad)
            await _until(lambda: len(reports) == count)  # noqa: B023
            assert reports[-1].error is not None
            assert not task.done()
        assert [str(r.error) for r in reports] == [
            f"{path}:2:4: invalid YAML: character U+0000 (NUL) is not allowed; "
            "is the file complete, and text?",
            f"{path}:1:11: invalid YAML: character U+0007 (BEL) is not allowed",
        ]
        assert router_pick(store) == "a"
        write(tmp_path, LONG)
        await _until(lambda: reports[-1].changed)
        assert router_pick(store) == "b"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def router_pick(store: PolicyStore) -> str | None:
    return Router(store).decide(request(), PODS).pod


def _raise(*_: object, **__: object) -> object:
    raise RuntimeError("disk on fire")


@pytest.mark.parametrize(
    "where",
    ["policyd.policy.store.load_policy_set", "policyd.policy.store.watched_files",
     "policyd.policy.store._stamp", "policyd.policy.store.new_warnings",
     "policyd.policy.store._report", "on_reload"],
)  # fmt: skip
@pytest.mark.parametrize("settle", [0.0, 0.01])
async def test_the_watcher_survives_an_exception_anywhere_in_a_reload(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    where: str,
    settle: float,
) -> None:
    path = write(tmp_path, SHORT)
    store = PolicyStore.open(path)
    store.settle_seconds = settle
    serving = store.current
    reports: list[Reload] = []
    listener = _raise if where == "on_reload" else reports.append
    if where != "on_reload":
        monkeypatch.setattr(where, _raise)
    looks = _Looks(store, monkeypatch)
    task = asyncio.create_task(store.watch(interval=0.01, on_reload=listener))  # type: ignore[arg-type]
    try:
        write(tmp_path, LONG)
        with caplog.at_level(logging.ERROR, logger="policyd.policy.store"):
            await _until(lambda: bool(caplog.records))
            await looks.more(10)  # the same failure is logged once
        assert not task.done()
        (record,) = caplog.records
        assert record.exc_info is not None
        assert "disk on fire" in str(record.exc_info[1])
        monkeypatch.undo()
        if where in ("policyd.policy.store._report", "on_reload"):
            assert store.current is not serving  # the reload itself went through
            assert router_pick(store) == "b"
            return
        assert store.current is serving
        assert reports and reports[0].error is not None
        assert "reload failed: RuntimeError: disk on fire" in str(reports[0].error)
        write(tmp_path, LONG + "\n")  # a later valid edit still loads
        await _until(lambda: reports[-1].changed)
        assert router_pick(store) == "b"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def _kubelet_projects(directory: Path, text: str, generation: int) -> None:
    """A ConfigMap volume update: a new timestamped directory, then one rename of ``..data``."""
    data = directory / f"..2026_12_01_00_00_0{generation}.000000000"
    data.mkdir()
    (data / "live.yaml").write_text(text)
    link = directory / "live.yaml"
    if not link.is_symlink():
        link.symlink_to(Path("..data") / "live.yaml")
    (directory / "..data_tmp").symlink_to(data.name)
    os.replace(directory / "..data_tmp", directory / "..data")


@pytest.mark.parametrize("watched", ["directory", "file"])
def test_a_config_map_swap_is_loaded_once_settled(tmp_path: Path, watched: str) -> None:
    _kubelet_projects(tmp_path, SHORT, 1)
    path = tmp_path if watched == "directory" else tmp_path / "live.yaml"
    store = PolicyStore.open(path, settle_seconds=1.0, refuse_new_warnings=True)
    assert store.poll(now=0.0) is None
    _kubelet_projects(tmp_path, LONG, 2)
    assert store.poll(now=10.0) is None  # first seen
    assert router_pick(store) == "a"
    result = store.poll(now=11.0)
    assert result is not None and result.changed and result.error is None
    assert router_pick(store) == "b"


async def test_a_failure_while_a_change_settles_does_not_speed_up_the_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, SHORT)
    store = PolicyStore.open(path, settle_seconds=0.3)
    looks: list[float] = []  # when each began
    real_stamp = store_module._stamp

    def failing(files: list[Path]) -> object:
        looks.append(time.monotonic())
        if len(looks) > 1:  # the first look saw the change start settling
            raise OSError("stale NFS handle")
        return real_stamp(files)

    monkeypatch.setattr(store_module, "_stamp", failing)
    task = asyncio.create_task(store.watch(interval=0.1))
    try:
        write(tmp_path, LONG)
        await _until(lambda: len(looks) >= 8)  # well past the settle time
        # After each failed look the next waits a whole interval (a failure that
        # kept the change settling would look every 10 ms once it was due). The
        # look after the first, which saw the change start settling, may come
        # sooner: the settle deadline draws near while a loaded machine is slow.
        gaps = [later - earlier for earlier, later in itertools.pairwise(looks[1:])]
        assert min(gaps) >= 0.09, gaps
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_serve_guards_reloads_unless_the_operator_opts_out(tmp_path: Path) -> None:
    from policyd.cli import build_parser
    from policyd.extproc.serve_command import UsageError, check_arguments, open_policy

    path = write(tmp_path, SHORT)
    pods = write(tmp_path, "pods: []\n", "pods.yaml")
    common = ["serve", "--policy", str(path), "--pods", str(pods)]
    store = open_policy(build_parser("serve").parse_args(common))
    assert (store.settle_seconds, store.refuse_new_warnings) == (1.0, True)
    opted = [*common, "--accept-policy-warnings", "--policy-settle-seconds", "0"]
    store = open_policy(build_parser("serve").parse_args(opted))
    assert (store.settle_seconds, store.refuse_new_warnings) == (0.0, False)
    negative = build_parser("serve").parse_args([*common, "--policy-settle-seconds", "-1"])
    with pytest.raises(UsageError, match="--policy-settle-seconds must not be negative"):
        check_arguments(negative)


def test_a_file_cut_mid_line_is_refused_under_the_guard_and_logged_without_it(
    tmp_path: Path,
) -> None:
    """A shed reason caught mid-word is a valid policy: only the missing final
    line break tells it from a finished edit."""
    path = write(tmp_path, GUARDED)
    store = PolicyStore.open(path, refuse_new_warnings=True)
    serving = store.current
    path.write_text(GUARDED.replace("every pod is busy\n", "every pod is bu"))
    result = store.reload()
    assert not result.changed and store.current is serving
    assert result.error is not None
    assert [str(d) for d in result.error.diagnostics if d.severity == "warning"] == [
        f"{path}:9:26: warning: the file ends mid-line (no final line break), unlike the "
        "version serving now: is the file complete?"
    ]
    store.refuse_new_warnings = False
    path.write_text(GUARDED.replace("every pod is busy\n", "every pod is b"))
    accepted = store.reload()
    assert accepted.changed and store.current is not serving
    assert any("ends mid-line" in d.message for d in accepted.warnings)


def test_a_policy_served_without_a_final_line_break_is_not_refused_for_it(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(SHORT.rstrip("\n"))
    store = PolicyStore.open(path, refuse_new_warnings=True)
    path.write_text(LONG.rstrip("\n"))
    assert store.reload().changed
    assert router_pick(store) == "b"
