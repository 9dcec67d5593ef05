"""The body budget's reservations: their share of the limit, and how a stalled one lapses."""

from __future__ import annotations

from policyd.extproc.budget import RESERVED_SHARE, BodyBudget, ByteBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Stream:
    """A reserver whose body has partly come (``arrived`` bytes)."""

    def __init__(self, budget: BodyBudget, size: int, arrived: int = 0) -> None:
        self.held = budget.reserve(self, size) or 0
        self.arrived = arrived
        self.lapses = 0

    def lapse(self) -> int:
        self.lapses += 1
        gone = max(self.held - self.arrived, 0)
        self.held -= gone
        return gone


def test_reservations_take_at_most_their_share_and_the_rest_is_let_through() -> None:
    budget = BodyBudget(1000, wait_seconds=5, clock=Clock())
    first, second = Stream(budget, 300), Stream(budget, 300)
    assert (first.held, second.held) == (300, 0)  # 600 > the share of 500: not reserved
    assert budget.reserved == 300 == budget.held
    assert RESERVED_SHARE == 0.5
    assert budget.take(700)  # bodies in hand fill the rest
    assert budget.reserve(Stream(budget, 0), 1) is None  # no room at all: a 429
    assert budget.refused == 1


def test_a_stalled_reservation_lapses_only_when_bytes_are_needed_and_it_is_due() -> None:
    clock = Clock()
    budget = BodyBudget(1000, wait_seconds=5, clock=clock)
    old = Stream(budget, 250, arrived=100)
    clock.now += 3
    young = Stream(budget, 250)
    assert budget.take(500)
    assert not budget.take(1)  # nothing is due yet
    assert old.lapses == 0
    clock.now += 2.5  # old is due, young is not
    assert budget.take(100)
    assert (old.lapses, young.lapses) == (1, 0)
    assert old.held == 100  # what had arrived stays held
    assert budget.held == 100 + 250 + 500 + 100
    assert budget.reserved == 250 and budget.lapsed == 1
    assert not budget.take(200)  # young is not due: no more room
    assert young.lapses == 0


def test_an_arrived_body_no_longer_lapses_and_giving_back_ends_the_reservation() -> None:
    clock = Clock()
    budget = BodyBudget(1000, wait_seconds=0, clock=clock)
    stream = Stream(budget, 400)
    budget.arrived(stream)
    assert budget.reserved == 0 and budget.held == 400
    assert not budget.take(700)
    assert stream.lapses == 0
    other = Stream(budget, 100)
    budget.give(100, other)
    budget.give(400, stream)
    assert budget.held == 0 and budget.reserved == 0


def test_a_byte_budget_counts_what_it_refuses() -> None:
    budget = ByteBudget(10)
    assert budget.take(10)
    assert not budget.take(1)
    budget.give(10)
    assert (budget.held, budget.refused) == (0, 1)
