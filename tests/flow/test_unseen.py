"""Unseen: what was sent to a pod counts until a scrape started after it could show it."""

from __future__ import annotations

from policyd.flow import unseen
from policyd.flow.unseen import ROUNDS, Unseen


def test_a_send_counts_until_rounds_snapshots_after_it() -> None:
    sends = Unseen()
    sends.snapshot_came(7)
    sends.sent("p0", 300)
    sends.sent("p0", 100)
    sends.sent("p1", 50)
    for version in range(8, 7 + ROUNDS):
        sends.snapshot_came(version)
        assert (sends.tokens, sends.count) == ({"p0": 400, "p1": 50}, {"p0": 2, "p1": 1})
    sends.snapshot_came(7 + ROUNDS)
    assert (sends.tokens, sends.count, bool(sends)) == ({}, {}, False)


def test_snapshots_flow_control_did_not_look_at_count_too() -> None:
    """Versions, not looks: a send is seen once the version is ROUNDS past its own."""
    sends = Unseen()
    sends.snapshot_came(1)
    sends.sent("p0", 300)
    sends.snapshot_came(1 + ROUNDS)
    assert not sends


def test_the_sends_remembered_are_bounded() -> None:
    """With no snapshot coming, the oldest send past the bound counts as seen."""
    sends = Unseen()
    for _ in range(unseen.MOST + 5):
        sends.sent("p0", 1)
    assert sends.count == {"p0": unseen.MOST} and sends.tokens == {"p0": unseen.MOST}
