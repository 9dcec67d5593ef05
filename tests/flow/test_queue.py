"""FlowQueue: strict priority, weighted fairness, order inside a flow, limits, expiry."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from policyd.flow.queue import BandLimits, FlowQueue, Held, Limits

HIGH = BandLimits("critical", 0, 60.0)
MID = BandLimits("standard", 1, 20.0)
LOW = BandLimits("sheddable", 2, 2.0)
BANDS = (HIGH, MID, LOW)


def held(
    band: BandLimits = MID,
    flow: str = "a",
    *,
    at: float = 0.0,
    weight: float = 1.0,
    size: int = 0,
    deadline: float | None = None,
) -> Held:
    return Held(f"{flow}@{at}", band, flow, weight=weight, size=size, arrived=at, deadline=deadline)


def drain(queue: FlowQueue) -> list[Held]:
    out = []
    while (item := queue.pop()) is not None:
        out.append(item)
    return out


def test_a_higher_band_is_always_served_first() -> None:
    queue = FlowQueue()
    for i, band in enumerate([LOW, MID, HIGH, LOW, HIGH, MID]):
        assert queue.push(held(band, at=float(i)))[0]
    assert [h.band.rank for h in drain(queue)] == [0, 0, 1, 1, 2, 2]


def test_inside_a_flow_fcfs_or_earliest_deadline() -> None:
    queue = FlowQueue()
    for i in range(4):
        queue.push(held(at=float(i)))
    assert [h.arrived for h in drain(queue)] == [0.0, 1.0, 2.0, 3.0]
    for i, deadline in enumerate([9.0, 3.0, 5.0]):
        queue.push(held(at=float(i), deadline=deadline))
    assert [h.key for h in drain(queue)] == [3.0, 5.0, 9.0]


def test_a_small_flow_is_not_stuck_behind_a_flood() -> None:
    queue = FlowQueue()
    for i in range(100):
        queue.push(held(flow="flood", at=i / 100))
    for i in range(5):
        queue.push(held(flow="small", at=1 + i))
    order = [h.flow for h in drain(queue)]
    # The small flow held nothing when it came: it goes first, then they take turns.
    assert [i for i, flow in enumerate(order) if flow == "small"] == [0, 2, 4, 6, 8]


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0, 5.0]), min_size=2, max_size=4),
    pops=st.integers(min_value=1, max_value=300),
)
def test_backlogged_flows_share_in_proportion_to_their_weights(
    weights: list[float], pops: int
) -> None:
    """Over any prefix of the service, flows that stay backlogged get requests in
    proportion to their weights within one round of credit (DRR's bound)."""
    queue = FlowQueue()
    for flow, weight in enumerate(weights):
        for i in range(400):
            queue.push(held(flow=str(flow), at=float(i), weight=weight))
    served = dict.fromkeys(map(str, range(len(weights))), 0)
    for _ in range(pops):
        item = queue.pop()
        assert item is not None
        served[item.flow] += 1
        normalized = [served[str(f)] / w for f, w in enumerate(weights)]
        bound = 1 + 1 / min(weights) + max(weights) / min(weights)
        assert max(normalized) - min(normalized) <= bound, (served, weights)


_ACTIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.integers(0, 2),
            st.sampled_from("abc"),
            st.integers(0, 50),
        ),
        st.tuples(st.just("pop"), st.just(0), st.just(""), st.just(0)),
        st.tuples(st.just("leave"), st.integers(0, 1000), st.just(""), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(actions=_ACTIONS, evict=st.booleans())
def test_the_limits_always_hold_and_nothing_is_lost(
    actions: list[tuple[str, int, str, int]], evict: bool
) -> None:
    """Every request pushed is, at the end, exactly one of: held, popped, evicted,
    refused, or taken out; the band and total limits are never exceeded."""
    bands = (
        BandLimits("critical", 0, 60.0),
        BandLimits("standard", 1, 60.0, max_requests=6, max_body_bytes=150),
        BandLimits("sheddable", 2, 60.0, max_requests=4),
    )
    queue = FlowQueue(Limits(max_requests=10, max_body_bytes=300, evict=evict))
    pushed: list[Held] = []
    popped, evicted, refused, left = [], [], [], []
    for step, (action, number, flow, size) in enumerate(actions):
        if action == "push":
            item = held(bands[number], flow, at=float(step), size=size)
            pushed.append(item)
            admitted, victims = queue.push(item)
            evicted += victims
            if not admitted:
                refused.append(item)
            for victim in victims:  # the lowest priority goes: never above the newcomer
                assert victim.band.rank >= item.band.rank
        elif action == "pop":
            if (item_ := queue.pop()) is not None:
                popped.append(item_)
        elif pushed:
            candidate = pushed[number % len(pushed)]
            if queue.remove(candidate):
                left.append(candidate)
        assert len(queue) <= 10 and queue.bytes <= 300
        assert queue.held_in("standard") <= 6 and queue.held_in("sheddable") <= 4
        assert sum(1 for _ in queue) == len(queue)
        assert sum(h.size for h in queue) == queue.bytes
    still = set(map(id, queue))
    outcomes = [still, {id(h) for h in popped}, {id(h) for h in evicted}]
    outcomes += [{id(h) for h in refused}, {id(h) for h in left}]
    for item in pushed:
        assert sum(id(item) in group for group in outcomes) == 1


def test_past_a_limit_the_flood_loses_its_own_newest_request() -> None:
    queue = FlowQueue(Limits(max_requests=4))
    queue.push(held(flow="small", at=0.0))
    for i in range(3):
        queue.push(held(flow="flood", at=1.0 + i))
    admitted, evicted = queue.push(held(flow="small", at=9.0))
    assert admitted and [(h.flow, h.arrived) for h in evicted] == [("flood", 3.0)]
    admitted, evicted = queue.push(held(flow="flood", at=10.0))
    assert not admitted and evicted == []  # the flood's newest is the newcomer itself


def test_a_total_limit_evicts_a_lower_band_never_a_higher_one() -> None:
    queue = FlowQueue(Limits(max_requests=2))
    queue.push(held(LOW, at=0.0))
    queue.push(held(HIGH, at=1.0))
    admitted, evicted = queue.push(held(MID, at=2.0))
    assert admitted and [h.band.name for h in evicted] == ["sheddable"]
    admitted, evicted = queue.push(held(LOW, at=3.0))
    assert not admitted and evicted == []
    refusing = FlowQueue(Limits(max_requests=1, evict=False))
    refusing.push(held(LOW, at=0.0))
    assert refusing.push(held(HIGH, at=1.0)) == (False, [])


def test_expiry_takes_out_what_waited_past_its_band() -> None:
    queue = FlowQueue()
    short, long_ = held(LOW, at=0.0), held(HIGH, at=0.0)
    queue.push(short)
    queue.push(long_)
    assert queue.next_expiry() == 2.0
    assert queue.expire(1.9) == []
    assert queue.expire(2.0) == [short]
    assert queue.next_expiry() == 60.0 and len(queue) == 1


def test_the_queue_position_on_arrival_counts_what_is_ahead() -> None:
    queue = FlowQueue()
    items = [held(LOW, at=0.0), held(MID, at=1.0), held(MID, at=2.0), held(HIGH, at=3.0)]
    for item in items:
        queue.push(item)
    assert [h.position for h in items] == [0, 0, 1, 0]


def test_a_request_put_back_is_next_again() -> None:
    queue = FlowQueue()
    for flow in "abc":
        queue.push(held(flow=flow))
    first = queue.pop()
    assert first is not None
    queue.unpop(first)
    assert queue.pop() is first and len(queue) == 2


def test_a_refused_request_is_not_in_the_queue_to_remove() -> None:
    """A request refused at a full queue, whose client then goes away, takes nothing out."""
    queue = FlowQueue(Limits(max_requests=1))
    kept = held(flow="a", at=0.0)
    refused = held(flow="a", at=1.0)
    assert queue.push(kept) == (True, [])
    assert queue.push(refused) == (False, [])
    assert not queue.remove(refused)
    assert len(queue) == 1 and queue.pop() is kept
