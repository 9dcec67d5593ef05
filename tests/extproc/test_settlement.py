"""The settlement: requests' bookkeeping run in batches on the event loop, in order."""

from __future__ import annotations

import asyncio
import logging

import pytest

from policyd.extproc.settlement import Settlement


class Item:
    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name = name
        self.log = log
        self.fail = fail

    def settle(self) -> None:
        self.log.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} failed")


def test_without_an_event_loop_an_item_is_settled_at_once() -> None:
    settled: list[str] = []
    settlement = Settlement()
    settlement.add(Item("a", settled).settle)
    assert settled == ["a"]
    assert settlement.idle


async def test_items_wait_for_the_delay_then_settle_together_in_order() -> None:
    settled: list[str] = []
    settlement = Settlement(delay_seconds=0.05)
    loop = asyncio.get_running_loop()
    added = loop.time()
    at: list[float] = []
    for name in "abc":
        settlement.add(Item(name, settled).settle)
    settlement.add(lambda: at.append(loop.time()))
    assert settled == []
    assert not settlement.idle
    for _ in range(3000):
        await asyncio.sleep(0.01)
        if settled:
            break
    assert settled == ["a", "b", "c"]
    assert at[0] - added >= 0.05  # not before the delay (a loaded machine only makes it later)
    assert settlement.idle
    settlement.add(Item("d", settled).settle)  # a new batch, a new timer
    await asyncio.sleep(0.1)
    assert settled == ["a", "b", "c", "d"]


async def test_flush_settles_now_and_the_timer_does_not_run_them_again() -> None:
    settled: list[str] = []
    settlement = Settlement(delay_seconds=0.02)
    settlement.add(Item("a", settled).settle)
    settlement.flush()
    assert settled == ["a"]
    await asyncio.sleep(0.05)
    assert settled == ["a"]


async def test_a_failing_item_is_logged_and_the_rest_still_settle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settled: list[str] = []
    settlement = Settlement(delay_seconds=0.01)
    settlement.add(Item("a", settled, fail=True).settle)
    settlement.add(Item("b", settled).settle)
    with caplog.at_level(logging.ERROR, logger="policyd.extproc"):
        settlement.flush()
    assert settled == ["a", "b"]
    assert "settling a request's bookkeeping failed" in caplog.text
