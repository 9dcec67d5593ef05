"""FlowControl: route or hold, dispatch one request per freed slot, late binding, answers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from policyd.flow import FlowAnswer, Held, Pass
from policyd.policy import Request, Router
from policyd.policy.router import Admission
from tests.flow.rig import POLICY, Client, Rig, Snapshot, kv_rig, rescrape, settle
from tests.policy.helpers import pod


def test_requests_pass_while_a_pod_has_room_then_are_held(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    verdicts = [rig.arrive(f"r{i}")[1] for i in range(6)]
    assert [type(v).__name__ for v in verdicts] == ["Pass"] * 4 + ["Held"] * 2
    assert sorted(p.load.count for p in rig.snapshot.candidates) == [2, 2]  # spread, no herd
    assert rig.control.held == 2


def test_one_freed_slot_dispatches_one_held_request(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    passed = [rig.arrive(f"r{i}")[0] for i in range(4)]
    held = [rig.arrive(f"h{i}")[0] for i in range(3)]
    rig.end(passed[0])
    assert [c.sent_to is not None for c in held] == [True, False, False]
    assert held[0].saw == [passed[0].sent_to]  # late binding: only the pod with room
    rig.end(passed[1])
    assert [c.sent_to is not None for c in held] == [True, True, False]


def test_a_stale_scrape_does_not_release_a_burst(tmp_path: Path) -> None:
    """The predicate reads only the scraped queue: the requests sent since the scrape
    count on their pod until the next snapshot, so a freed pod takes two, not all."""
    text = POLICY.replace(" || pod.in_flight >= 2", "")
    rig = Rig(tmp_path, text)
    first = [rig.arrive(f"r{i}")[0] for i in range(4)]
    assert all(c.sent_to for c in first)
    held = [rig.arrive(f"h{i}")[0] for i in range(5)]
    assert not any(c.sent_to for c in held)
    # A new scrape: p0 still queues 2, p1 has drained.
    rig.snapshot = Snapshot((pod("p0", waiting_queue=2), pod("p1", waiting_queue=0)), version=1)
    rig.control.pump()
    assert [c.sent_to for c in held] == ["p1", "p1", None, None, None]


def test_a_small_tenant_goes_before_a_flood(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    passed = [rig.arrive(f"r{i}", **{"x-tenant": "flood"})[0] for i in range(4)]
    flood = [rig.arrive(f"f{i}", **{"x-tenant": "flood"})[0] for i in range(10)]
    small = rig.arrive("s", **{"x-tenant": "small"})[0]
    rig.end(passed[0])
    rig.end(passed[1])
    assert small.sent_to is not None
    assert sum(c.sent_to is not None for c in flood) == 1


def test_critical_goes_first(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    passed = [rig.arrive(f"r{i}")[0] for i in range(4)]
    standard = rig.arrive("std")[0]
    critical = rig.arrive("crit", **{"x-gateway-inference-criticality": "critical"})[0]
    rig.end(passed[0])
    assert critical.sent_to is not None and standard.sent_to is None


def test_expiry_answers_with_the_policy_status(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    for i in range(4):
        rig.arrive(f"r{i}")
    waiting, verdict = rig.arrive("w")
    assert isinstance(verdict, Held) and rig.control.next_expiry() == 10.0
    rig.now = 10.0
    rig.control.pump()
    assert waiting.answered == FlowAnswer(
        429, 3, "flow_expired", "held past the maximum wait of its band: no pod had room for it"
    )
    assert rig.control.held == 0 and rig.control.next_expiry() is None


def test_a_client_that_leaves_is_out_of_the_queue(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    passed = [rig.arrive(f"r{i}")[0] for i in range(4)]
    gone, verdict = rig.arrive("gone")
    stays = rig.arrive("stays")[0]
    assert isinstance(verdict, Held)
    rig.control.leave(verdict)
    assert rig.control.held == 1
    rig.end(passed[0])
    assert gone.sent_to is None and stays.sent_to is not None


def test_a_reload_applies_to_held_requests_at_dispatch(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    for i in range(4):
        rig.arrive(f"r{i}")
    held = [rig.arrive(f"h{i}")[0] for i in range(3)]
    rig.path.write_text(POLICY.replace("pod.waiting_queue >= 2 || pod.in_flight >= 2", "false"))
    assert rig.store.reload().changed
    rig.control.pump()
    assert all(c.sent_to for c in held)


def test_close_answers_every_held_request(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    for i in range(4):
        rig.arrive(f"r{i}")
    held = [rig.arrive(f"h{i}")[0] for i in range(2)]
    answer = FlowAnswer(503, None, "flow_shutdown", "policyd is shutting down")
    assert rig.control.close(answer) == 2
    assert [c.answered for c in held] == [answer, answer] and rig.control.held == 0


def test_a_request_the_queue_would_dispatch_as_it_arrives_passes(tmp_path: Path) -> None:
    """Room appeared with no signal yet: the arriving request's own pump dispatches what
    was held first, then lets the new one pass (its owner does not hold it yet)."""
    rig = Rig(tmp_path)
    for i in range(4):
        rig.arrive(f"r{i}")
    held = [rig.arrive(f"h{i}")[0] for i in range(2)]
    # A new scrape: every request ended, and no signal told flow control so far.
    rig.snapshot = Snapshot((pod("p0"), pod("p1")), version=1)
    late, verdict = rig.arrive("late")
    assert all(c.sent_to for c in held)
    assert isinstance(verdict, Pass) and late.sent_to is not None
    assert rig.control.held == 0


def test_the_kv_estimate_paces_what_the_scrape_has_not_seen(tmp_path: Path) -> None:
    """Each request counts its prompt plus half its max_tokens (300 of 1000 tokens)
    on its pod: two fit under 0.5 per pod, though the scrape still reads 0; once the
    scrape shows one of them gone, the held request goes there."""
    rig = kv_rig(tmp_path)
    first = [rig.arrive(f"r{i}", (200, 200)) for i in range(5)]
    assert [type(v).__name__ for _, v in first] == ["Pass"] * 4 + ["Held"]
    assert sorted(c.sent_to or "" for c, _ in first[:4]) == ["p0", "p0", "p1", "p1"]
    rig.end(first[0][0])
    settle(rig, (0.3, 0.6) if first[0][0].sent_to == "p0" else (0.6, 0.3))
    rig.control.pump()
    assert first[4][0].sent_to == first[0][0].sent_to


def test_a_scrape_taken_before_the_sends_reached_the_pods_releases_nothing(
    tmp_path: Path,
) -> None:
    """The flood fills both pods (0.6 each by the estimate); a scrape comes that the
    sends had not reached yet (empty pods). The small tenant, under its share, reads
    the scrape plus what it has not seen: still full, so it is held rather than sent
    to a pod that is about to be full."""
    rig = kv_rig(tmp_path)
    flood = [rig.arrive(f"f{i}", (200, 200), **{"x-tenant": "flood"})[1] for i in range(4)]
    assert all(isinstance(v, Pass) for v in flood)
    rescrape(rig, 0.0, running=(0, 0))
    assert isinstance(rig.arrive("s", (200, 200), **{"x-tenant": "small"})[1], Held)


def test_a_flow_under_its_share_reads_the_scrape_and_what_it_has_not_seen(
    tmp_path: Path,
) -> None:
    """The flood is paced by the estimate (0.6 a pod); requests early in their life hold
    less than that (the scrape reads 0.3), and the small tenant, with nothing in flight,
    reads the scrape: it passes while the flood is held."""
    rig = kv_rig(tmp_path)
    flood = [rig.arrive(f"f{i}", (200, 200), **{"x-tenant": "flood"}) for i in range(6)]
    assert [type(v).__name__ for _, v in flood] == ["Pass"] * 4 + ["Held"] * 2
    settle(rig, 0.3)
    rig.control.pump()
    assert rig.control.held == 2
    small, verdict = rig.arrive("s", (200, 200), **{"x-tenant": "small"})
    assert isinstance(verdict, Pass) and small.sent_to is not None
    # What it sends counts on its pod as the scrape has not seen it: the next small
    # request goes to the other pod, and once both read 0.6 it is held.
    second, verdict = rig.arrive("s2", (200, 200), **{"x-tenant": "small"})
    assert isinstance(verdict, Pass) and second.sent_to not in (None, small.sent_to)
    assert isinstance(rig.arrive("s3", (200, 200), **{"x-tenant": "small"})[1], Held)


def test_an_end_frees_room_once_the_scrape_shows_it(tmp_path: Path) -> None:
    """The scrape reads both pods at 0.6; a flood request's end reaches policyd. The
    pod may have finished it long before (the scrape already counts it gone), so the
    end itself frees nothing: the small tenant is held until a scrape shows p0 at
    0.3, then goes there."""
    rig = kv_rig(tmp_path)
    flood = [rig.arrive(f"f{i}", (200, 200), **{"x-tenant": "flood"})[0] for i in range(4)]
    settle(rig, 0.6)
    assert isinstance(rig.arrive("f4", (200, 200), **{"x-tenant": "flood"})[1], Held)
    rig.end(next(c for c in flood if c.sent_to == "p0"))
    small, verdict = rig.arrive("s", (200, 200), **{"x-tenant": "small"})
    assert isinstance(verdict, Held)
    rescrape(rig, (0.3, 0.6))
    rig.control.pump()
    assert small.sent_to == "p0"


def test_the_estimate_counts_only_what_the_pod_still_runs(tmp_path: Path) -> None:
    """The flood fills both pods by the estimate; then the pods finish every request
    while their ends have not reached policyd yet (a busy proxy relays them late). The
    scrape reads the pods empty, running nothing: the estimate counts none of the
    requests the pods no longer hold, and the held flood request goes."""
    rig = kv_rig(tmp_path)
    flood = [rig.arrive(f"f{i}", (200, 200), **{"x-tenant": "flood"}) for i in range(5)]
    assert [type(v).__name__ for _, v in flood] == ["Pass"] * 4 + ["Held"]
    settle(rig, 0.6)
    rig.control.pump()
    assert flood[4][0].sent_to is None
    settle(rig, 0.0, running=(0, 0))
    rig.control.pump()
    assert flood[4][0].sent_to is not None


def test_the_estimate_learns_what_the_pods_report(tmp_path: Path) -> None:
    """The pods count half the prompt policyd estimates and generate half the budget:
    once they have said so, a request costs 150 tokens, not 300, and four fit per pod."""
    rig = kv_rig(tmp_path)
    for i in range(30):
        client, verdict = rig.arrive(f"w{i}", (200, 200))
        assert isinstance(verdict, Pass)
        rig.end(client, (100, 100))
        settle(rig, 0.0, running=(0, 0))
    verdicts = [rig.arrive(f"r{i}", (200, 200))[1] for i in range(9)]
    assert [type(v).__name__ for v in verdicts] == ["Pass"] * 8 + ["Held"]


def test_only_requests_under_flow_control_teach_it(tmp_path: Path) -> None:
    """A report for a request flow control never saw in flight changes nothing."""
    rig = kv_rig(tmp_path)
    stranger = Client("stranger", rig.router)
    for _ in range(30):
        rig.control.finished("p0", stranger, (1, 1))
    verdicts = [rig.arrive(f"r{i}", (200, 200))[1] for i in range(5)]
    assert [type(v).__name__ for v in verdicts] == ["Pass"] * 4 + ["Held"]


def test_a_lower_band_leaves_room_for_a_higher_one_in_flight(tmp_path: Path) -> None:
    """With a critical request in flight, a standard request keeps one average request
    (300 tokens) free on each pod: the second standard request is held, while a
    critical one still finds room."""
    rig = kv_rig(tmp_path)
    critical = {"x-gateway-inference-criticality": "critical"}
    first, verdict = rig.arrive("c0", (200, 200), **critical)
    assert isinstance(verdict, Pass)
    standard, verdict = rig.arrive("s0", (200, 200))
    assert isinstance(verdict, Pass) and standard.sent_to != first.sent_to
    assert isinstance(rig.arrive("s1", (200, 200))[1], Held)
    assert isinstance(rig.arrive("c1", (200, 200), **critical)[1], Pass)


def test_a_flood_leaves_room_for_another_flow_in_flight(tmp_path: Path) -> None:
    """The small tenant has a request in flight; the flood, over its share, keeps one
    average request free on each pod, which the small tenant's next request takes."""
    rig = kv_rig(tmp_path)
    rig.arrive("s0", (200, 200), **{"x-tenant": "small"})
    flood = [rig.arrive(f"f{i}", (200, 200), **{"x-tenant": "flood"})[1] for i in range(3)]
    # Without the reserve all three pass and fill both pods (two requests each).
    assert isinstance(flood[-1], Held)
    _, verdict = rig.arrive("s1", (200, 200), **{"x-tenant": "small"})
    assert isinstance(verdict, Pass)


def test_a_flow_under_its_share_keeps_the_reserve_for_a_higher_band(tmp_path: Path) -> None:
    """The small tenant has nothing in flight (under any share), yet a critical request
    is: its standard request keeps one average request (300 tokens) free on each pod
    too, so only the empty pod has room for it."""
    rig = kv_rig(tmp_path)
    critical = {"x-gateway-inference-criticality": "critical", "x-tenant": "flood"}
    first, verdict = rig.arrive("c0", (200, 200), **critical)
    assert isinstance(verdict, Pass)
    small, verdict = rig.arrive("s0", (100, 100), **{"x-tenant": "small"})
    assert isinstance(verdict, Pass)
    assert small.saw == [p.name for p in rig.snapshot.candidates if p.name != first.sent_to]


class Failing(Client):
    """A request whose routing raises at dispatch (a bug of policyd's own)."""

    def dispatch(self, candidates: Sequence[Any]) -> str | None:
        raise RuntimeError("boom")


def test_a_request_that_fails_at_dispatch_is_answered_and_the_rest_go_on(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    passed = [rig.arrive(f"r{i}")[0] for i in range(4)]
    request = Request("m", headers={})
    admission = rig.router.admission(request)
    assert admission is not None
    failing = Failing("failing", rig.router)
    assert isinstance(rig.control.arrive(admission, request, 10, failing), Held)
    behind = rig.arrive("behind")[0]
    rig.end(passed[0])  # one slot: the failing request takes it and fails
    assert failing.answered is not None and failing.answered.status == 500
    assert failing.answered.code == "flow_failed"
    rig.end(passed[1])
    assert behind.sent_to is not None and rig.control.held == 0


def test_a_request_whose_admission_fails_at_dispatch_is_answered(tmp_path: Path) -> None:
    """The policy raises for one held request when it is dispatched: that request is
    answered 500, the next one is dispatched in the same pump."""
    rig = Rig(tmp_path)
    passed = [rig.arrive(f"r{i}")[0] for i in range(4)]
    broken = rig.arrive("broken", **{"x-tenant": "broken"})[0]
    behind = rig.arrive("behind", **{"x-tenant": "other"})[0]
    router = rig.router

    class Broken(Router):
        def admission(self, request: Request) -> Admission | None:
            if request.headers.get("x-tenant") == "broken":
                raise RuntimeError("boom")
            return router.admission(request)

    rig.router = Broken(rig.store)  # what flow control asks from now on
    rig.end(passed[0])
    assert broken.answered is not None and broken.answered.status == 500
    assert behind.sent_to is not None


def test_past_max_flows_new_keys_share_the_overflow_flow_at_the_back(tmp_path: Path) -> None:
    """``max_flows: 3``: flow ``a`` is held and in flight (two), ``b`` makes three; ``c``
    and ``d`` share the overflow flow, which waits behind ``a``'s turn, while ``vip``,
    named under the weights, gets a flow of its own and goes first."""
    text = POLICY.replace("  answer:", "  max_flows: 3\n  answer:").replace(
        '    key: request.headers["x-tenant"]',
        '    key: request.headers["x-tenant"]\n    weights: {vip: 2}',
    )
    rig = Rig(tmp_path, text)
    passed = [rig.arrive(f"r{i}", **{"x-tenant": "a"})[0] for i in range(4)]
    a = rig.arrive("a", **{"x-tenant": "a"})[0]
    waiting = [rig.arrive(name, **{"x-tenant": name})[0] for name in ("b", "c", "d", "vip")]
    order = []
    for client in passed:
        rig.end(client)
        order += [c.name for c in [a, *waiting] if c.sent_to and c.name not in order]
    assert order == ["vip", "b", "a", "c"]
