"""Attack: a client that makes up a new flow key (tenant) for every request.

A flow whose queue is empty goes first in its band's turns when its request
comes, so each made-up key jumped ahead of the flows waiting their turn, and
each one was a flow of its own in memory. The policy's ``max_flows`` bounds
the flows held or in flight; the keys past it share one overflow flow that
takes its turns at the back.
"""

from __future__ import annotations

from pathlib import Path

from policyd.flow import FlowControl, Held
from tests.flow.rig import POLICY, Client, Rig

MAX_FLOWS = 100  # the policy's default ``max_flows``
BIG = {"x-tenant": "big"}


class Flows:
    """The observer flow control reports to (Prometheus's, in policyd serve): the
    most flows it held requests under at once."""

    def __init__(self) -> None:
        self.held_by: dict[str, int] = {}
        self.most = 0

    def held(self, band: str, flow: str, change: int, model: str) -> None:
        count = self.held_by.get(flow, 0) + change
        if count:
            self.held_by[flow] = count
        else:
            del self.held_by[flow]
        self.most = max(self.most, len(self.held_by))

    def outcome(self, band: str, flow: str, outcome: str, waited_s: float) -> None:
        return None


def capped_rig(tmp_path: Path, pods: int) -> tuple[Rig, Flows]:
    rig = Rig(tmp_path, POLICY, pods)
    flows = Flows()
    rig.control = FlowControl(lambda: rig.router, lambda: rig.snapshot, lambda: rig.now, flows)
    return rig, flows


def test_ten_thousand_made_up_keys_neither_make_as_many_flows_nor_go_first(
    tmp_path: Path,
) -> None:
    rig, flows = capped_rig(tmp_path, pods=2)
    in_flight = [rig.arrive(f"r{i}", **BIG)[0] for i in range(4)]  # both pods full
    big = [rig.arrive(f"b{i}", **BIG)[0] for i in range(200)]
    made_up = [rig.arrive(f"k{i}", **{"x-tenant": f"k{i}"})[0] for i in range(10_000)]
    assert all(isinstance(c, Client) for c in made_up) and rig.control.held == 10_200
    assert flows.most <= MAX_FLOWS + 1  # its own, plus the overflow flow
    # One slot frees at a time, 200 times: who goes?
    served: list[str] = []
    waiting = {id(c): "big" for c in big} | {id(c): "made-up" for c in made_up}
    for _ in range(200):
        rig.end(in_flight.pop(0))
        went = [c for c in big + made_up if c.sent_to and id(c) in waiting]
        assert len(went) == 1
        served.append(waiting.pop(id(went[0])))
        in_flight.append(went[0])
    # At most MAX_FLOWS made-up flows went before it; then it takes every other turn,
    # sharing the band with the overflow flow alone.
    assert "big" in served[: MAX_FLOWS + 1]
    assert served.count("big") >= (200 - MAX_FLOWS) // 2


def test_a_new_key_on_every_request_cannot_take_every_slot(tmp_path: Path) -> None:
    """Made-up keys arrive one per freed slot, each finding its predecessor already
    dispatched: without a bound each went first, and the waiting flow got no slot."""
    rig, flows = capped_rig(tmp_path, pods=64)  # 128 slots: more than MAX_FLOWS
    in_flight = [rig.arrive(f"r{i}", **BIG)[0] for i in range(128)]
    big = [rig.arrive(f"b{i}", **BIG)[0] for i in range(300)]
    waiting = list(big)
    dispatched_big = 0
    for i in range(300):
        made_up, verdict = rig.arrive(f"k{i}", **{"x-tenant": f"k{i}"})
        assert isinstance(verdict, Held)
        waiting.append(made_up)
        rig.end(in_flight.pop(0))
        went = [c for c in waiting if c.sent_to]
        assert len(went) == 1
        waiting.remove(went[0])
        dispatched_big += went[0] in big
        in_flight.append(went[0])
    assert flows.most <= MAX_FLOWS + 1
    # The made-up keys' own flows hold at most MAX_FLOWS of the 128 slots, each going
    # first once; the rest go to the big flow and the overflow flow in turn.
    assert dispatched_big >= 300 * (128 - MAX_FLOWS) // 128 // 4
