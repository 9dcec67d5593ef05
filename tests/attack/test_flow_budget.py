"""Attack: a request with a budget no model has (``max_tokens`` of 10**400 or 1e300).

Such a request reaches flow control's footprint as a Python int when nothing
bounds it before (``policyd/extproc/openai.py`` does now; flow control must
hold on its own). 10**400 made the footprint raise ``OverflowError`` at
dispatch, outside any ``try``: out of the timer's pump, which then stopped,
and out of another request's end. 1e300 poisoned the mean estimate (the
reserve) and the learned budget ratio for every request after it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from policyd.extproc.holding import Holding
from policyd.flow import Held, Pass
from tests.flow.rig import Rig, Snapshot, kv_rig, settle

HUGE = [pytest.param(10**400, id="10e400"), pytest.param(int(1e300), id="1e300")]


def test_a_huge_budget_held_then_dispatched_stops_no_other_request(tmp_path: Path) -> None:
    """It is dispatched at another request's end; that end and the requests held
    behind it go on, and once it ends its pod takes requests again."""
    rig = kv_rig(tmp_path)  # two pods of 1000 tokens, saturated at 0.5
    passed = [rig.arrive(f"r{i}", (200, 200))[0] for i in range(4)]
    huge, verdict = rig.arrive("huge", (200, 10**400))
    assert isinstance(verdict, Held)
    behind = [rig.arrive(f"h{i}", (200, 200))[0] for i in range(2)]
    for client in passed:
        rig.end(client)  # raised OverflowError at the first, with 10**400
    settle(rig, 0.0, running=(0, 0))  # the scrape shows the pods empty
    rig.control.pump()
    assert huge.sent_to is not None
    # Its pod reads full while it runs: the two behind it went to the other pod.
    assert [c.sent_to for c in behind] == [
        p.name for p in rig.snapshot.candidates if p.name != huge.sent_to
    ] * 2
    rig.end(huge, (200, 100))
    settle(rig, tuple(0.0 if p.name == huge.sent_to else 0.6 for p in rig.snapshot.candidates))
    after = [rig.arrive(f"a{i}", (200, 200)) for i in range(2)]
    assert [c.sent_to for c, _ in after] == [huge.sent_to] * 2
    assert all(isinstance(v, Pass) for _, v in after)


async def test_a_huge_budget_dispatched_by_the_timer_does_not_stop_it(tmp_path: Path) -> None:
    """The serving path's timer pumps flow control; the huge request is dispatched
    there. The timer keeps going: a request held behind it is dispatched on a later
    tick, when a new scrape shows room, with no other signal."""
    rig = Rig(tmp_path)  # saturated at two in flight (or queued) per pod
    holding = Holding(lambda: rig.router, lambda: rig.snapshot, tick_seconds=0.005)
    rig.control = holding.control
    for i in range(4):
        rig.arrive(f"r{i}", (200, 200))
    huge, _ = rig.arrive("huge", (200, 10**400))
    behind, verdict = rig.arrive("behind", (200, 200))
    assert isinstance(verdict, Held) and rig.control.held == 2
    holding.held()
    try:
        # A scrape: p0 has room for one (its requests not counted ended, as none said).
        p0, p1 = rig.snapshot.candidates
        p0.load.count = 1
        rig.snapshot = Snapshot((p0, p1), version=1)
        await _until(lambda: huge.sent_to is not None)
        assert behind.sent_to is None
        p1.load.count = 0  # a later scrape: p1 is empty
        rig.snapshot = Snapshot((p0, p1), version=2)
        await _until(lambda: behind.sent_to is not None)
        assert behind.sent_to == "p1"
    finally:
        holding.stop()


@pytest.mark.parametrize("budget", HUGE)
def test_a_huge_budget_does_not_poison_the_estimate_for_the_requests_after_it(
    tmp_path: Path, budget: int
) -> None:
    """Two runs alike but for one request's budget (200, or huge): the requests after
    it, paced by the estimate and the reserve for a higher band, are treated alike."""

    def run(attack_budget: int, folder: str) -> list[str]:
        (tmp_path / folder).mkdir()
        rig = kv_rig(tmp_path / folder)
        for i in range(40):  # the estimate learns: the pods count what policyd does
            client, _ = rig.arrive(f"w{i}", (200, 200))
            rig.end(client, (200, 200))
            settle(rig, 0.0, running=(0, 0))
        fill = [rig.arrive(f"r{i}", (200, 200))[0] for i in range(4)]
        attack, verdict = rig.arrive("attack", (200, attack_budget))
        assert isinstance(verdict, Held)
        for client in fill:
            rig.end(client)
        settle(rig, 0.0, running=(0, 0))  # the scrape shows the pods empty
        rig.control.pump()
        assert attack.sent_to is not None
        rig.end(attack, (200, 100))
        settle(rig, 0.0, running=(0, 0))
        # A critical request in flight: standard ones keep room for one average request.
        critical = {"x-gateway-inference-criticality": "critical"}
        verdicts = [rig.arrive("c0", (200, 200), **critical)[1]]
        verdicts += [rig.arrive(f"s{i}", (100, 100))[1] for i in range(3)]
        return [type(v).__name__ for v in verdicts]

    baseline = run(200, "baseline")
    assert baseline == ["Pass", "Pass", "Pass", "Held"]  # the reserve paces the third
    assert run(budget, "attacked") == baseline


async def _until(condition: object) -> None:
    """Let the event loop run (the timer's ticks) until ``condition()`` holds; a
    bounded number of turns, so a timer that stopped fails the test instead of hanging."""
    assert callable(condition)
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the flow-control timer stopped: nothing was dispatched")


async def test_a_look_that_fails_as_a_whole_does_not_stop_the_timer(tmp_path: Path) -> None:
    """The policy source raising (not any one request) fails that tick only: held
    requests are still dispatched on a later tick, once the source answers again."""
    rig = Rig(tmp_path)  # saturated at two in flight (or queued) per pod
    broken = {"now": False}

    def routers() -> object:
        if broken["now"]:
            raise RuntimeError("the policy source is broken for now")
        return rig.router

    holding = Holding(routers, lambda: rig.snapshot, tick_seconds=0.005)  # type: ignore[arg-type]
    rig.control = holding.control
    for i in range(4):
        rig.arrive(f"r{i}", (200, 200))
    waiting, verdict = rig.arrive("waiting", (200, 200))
    assert isinstance(verdict, Held)
    broken["now"] = True
    holding.held()
    try:
        p0, p1 = rig.snapshot.candidates
        p0.load.count = 0  # a scrape shows room; the broken source fails the looks
        rig.snapshot = Snapshot((p0, p1), version=1)
        for _ in range(5):
            await asyncio.sleep(0.005)
        assert waiting.sent_to is None
        broken["now"] = False
        await _until(lambda: waiting.sent_to is not None)
        assert waiting.sent_to == "p0"
    finally:
        holding.stop()
