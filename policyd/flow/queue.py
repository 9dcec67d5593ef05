"""The held requests of one policy: bands, flows, order, limits, expiry (``FlowQueue``).

- **Strict priority between bands**: ``pop`` serves the highest band (rank 0
  first) holding anything.
- **Fairness between flows inside a band**: deficit round robin. The flows
  holding requests take turns; on its turn a flow earns its weight in
  credit and is served one request per unit of credit, so over any stretch
  in which two flows stay backlogged each gets requests in proportion to its
  weight, within about one request (``tests/flow/test_queue.py`` holds it
  to that). A flow that empties loses its credit: idling earns nothing. A
  flow that held nothing goes to the front of the turns when its request
  comes (as fq_codel's new flows do): a sparse flow (a small tenant, one
  request at a time) waits for the next free slot, not behind a flood's turn,
  while flows that stay backlogged still share by weight. The overflow flow
  (``OVERFLOW_FLOW``: the keys past the policy's ``max_flows``, ``control.py``)
  is the exception: it joins the back of the turns, so the keys a client
  makes up past the bound never go first.
- **Order inside a flow**: by ``Held.key``, the arrival (FCFS) or the
  deadline, then the arrival sequence.
- **Limits**: per band (from the request's band) and in total. Past one the
  lowest-priority held request is evicted: in the band over its limit, or for
  a total limit the lowest band holding anything, never a band above the new
  request's (then the new request is refused instead). Inside that band the
  victim is the last-served request of the flow holding the most for its
  weight, so a flood evicts its own requests. ``refuse`` refuses the new
  request at any limit.
- **Expiry**: ``expire(now)`` takes out every request held past its band's wait.

Removal is lazy: a request taken out (expired, evicted, its client gone) is
marked and skipped when its heaps reach it, while the counts that the limits
read change at once. Everything runs on one thread (the event loop, or the
simulator's), with no lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

OVERFLOW_FLOW: Final = "(overflow)"  # the flow of the keys past ``max_flows``: never first


@dataclass(frozen=True, slots=True)
class BandLimits:
    """One band as the queue sees it: its place and its own limits."""

    name: str
    rank: int  # 0 is the highest priority
    max_wait_s: float
    max_requests: int | None = None
    max_body_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    """What the whole queue may hold, and what happens past it."""

    max_requests: int | None = None
    max_body_bytes: int | None = None
    evict: bool = True  # False: refuse the new request instead


class Held:
    """One held request: where it waits, since when, until when, and what it carries."""

    __slots__ = (
        "arrived",
        "band",
        "expires",
        "flow",
        "gone",
        "key",
        "payload",
        "position",
        "seq",
        "size",
        "weight",
    )

    def __init__(
        self,
        payload: Any,
        band: BandLimits,
        flow: str,
        *,
        weight: float = 1.0,
        size: int = 0,
        arrived: float,
        deadline: float | None = None,
    ) -> None:
        self.payload = payload
        self.band = band
        self.flow = flow
        self.weight = weight
        self.size = size
        self.arrived = arrived
        self.expires = arrived + band.max_wait_s
        self.key = arrived if deadline is None else deadline
        self.seq = 0
        self.position = 0  # requests held ahead of it (its band and above) when it came
        self.gone = True  # not in a queue: until pushed, and once popped, evicted or removed

    def __lt__(self, other: Held) -> bool:  # heap order: key, then arrival
        return (self.key, self.seq) < (other.key, other.seq)


class _Flow:
    """One flow's held requests in one band, and its round-robin credit."""

    __slots__ = ("deficit", "first", "last", "live", "name", "weight")

    def __init__(self, name: str, weight: float) -> None:
        self.name = name
        self.weight = weight
        self.deficit = 0.0
        self.first: list[Held] = []  # min-heap: the next to serve
        self.last: list[tuple[float, int, Held]] = []  # max-heap: the last to serve
        self.live = 0

    def push(self, held: Held) -> None:
        heapq.heappush(self.first, held)
        heapq.heappush(self.last, (-held.key, -held.seq, held))
        self.live += 1

    def pop_first(self) -> Held:
        while True:
            held = heapq.heappop(self.first)
            if not held.gone:
                return held

    def peek_last(self) -> Held:
        while self.last[0][2].gone:
            heapq.heappop(self.last)
        return self.last[0][2]


class _Band:
    __slots__ = ("active", "bytes", "count", "flows", "limits")

    def __init__(self, limits: BandLimits) -> None:
        self.limits = limits
        self.flows: dict[str, _Flow] = {}
        self.active: deque[_Flow] = deque()  # the flows holding requests, in turn order
        self.count = 0
        self.bytes = 0

    def push(self, held: Held) -> None:
        flow = self.flows.get(held.flow)
        if flow is None:  # a flow that held nothing: its turn comes first (see the docstring)
            flow = self.flows[held.flow] = _Flow(held.flow, held.weight)
            if held.flow == OVERFLOW_FLOW:
                self.active.append(flow)
            else:
                self.active.appendleft(flow)
        flow.weight = held.weight  # the weight of the newest request: a reload applies
        flow.push(held)
        self.count += 1
        self.bytes += held.size

    def pop(self) -> Held:
        """Deficit round robin over the active flows (the band holds something)."""
        active = self.active
        while True:
            flow = active[0]
            if flow.deficit < 1.0:
                flow.deficit += flow.weight
                if flow.deficit < 1.0:
                    active.rotate(-1)
                    continue
            held = flow.pop_first()
            flow.deficit -= 1.0
            flow.live -= 1
            self._taken(held)
            if flow.live == 0:
                active.popleft()
                del self.flows[flow.name]
            elif flow.deficit < 1.0:
                active.rotate(-1)
            return held

    def unpop(self, held: Held) -> None:
        """Put back the request ``pop`` just gave, first in line again."""
        flow = self.flows.get(held.flow)
        if flow is None:
            flow = self.flows[held.flow] = _Flow(held.flow, held.weight)
        else:
            self.active.remove(flow)
        self.active.appendleft(flow)
        flow.deficit += 1.0
        flow.push(held)
        self.count += 1
        self.bytes += held.size

    def remove(self, held: Held) -> None:
        """Take out a request still held (lazily: its heaps skip it)."""
        held.gone = True
        flow = self.flows[held.flow]
        flow.live -= 1
        self._taken(held)
        if flow.live == 0:
            self.active.remove(flow)
            del self.flows[flow.name]

    def victim(self, incoming: Held | None) -> Held | None:
        """The request to evict: the last to serve of the flow holding most for its
        weight, counting ``incoming`` (of this band) in; None when that is ``incoming``."""

        def load(flow: _Flow) -> float:
            extra = 1 if incoming is not None and flow.name == incoming.flow else 0
            return (flow.live + extra) / flow.weight

        heaviest = max(self.active, key=load) if self.active else None
        if (
            incoming is not None
            and incoming.flow not in self.flows
            and (heaviest is None or 1 / incoming.weight > load(heaviest))
        ):
            return None  # a new flow alone is over its share: it goes
        if heaviest is None:
            return None
        last = heaviest.peek_last()
        if incoming is not None and heaviest.name == incoming.flow and last < incoming:
            return None  # its own flow's last to serve is the newcomer itself
        return last

    def _taken(self, held: Held) -> None:
        self.count -= 1
        self.bytes -= held.size


class FlowQueue:
    """One policy's held requests (see the module docstring)."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self._bands: dict[str, _Band] = {}
        self._order: list[_Band] = []  # by rank
        self._expiry: list[tuple[float, int, Held]] = []
        self._seq = itertools.count()
        self.count = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Held]:
        """Every held request, in no particular order."""
        for band in self._order:
            for flow in band.flows.values():
                yield from (held for held in flow.first if not held.gone)

    def flows(self) -> int:
        """How many flows hold requests, over every band (a key in two bands: two)."""
        return sum(len(band.flows) for band in self._order)

    def holds(self, flow: str) -> bool:
        """Whether ``flow`` holds requests in some band."""
        return any(flow in band.flows for band in self._order)

    def held_in(self, band: str) -> int:
        found = self._bands.get(band)
        return found.count if found is not None else 0

    def push(self, held: Held) -> tuple[bool, list[Held]]:
        """Hold ``held``: whether it is held (False: refused), and the requests evicted for it."""
        band = self._band(held.band)
        limits = held.band
        total = self.limits
        if _over(1, held.size, limits.max_requests, limits.max_body_bytes) or _over(
            1, held.size, total.max_requests, total.max_body_bytes
        ):
            return False, []  # alone it is over a limit: nothing evicted makes room
        # Evicted one by one until the newcomer fits; if it turns out to be the next
        # to go, it is refused and those evicted for it stay evicted (the limits hold).
        victims: list[Held] = []
        while _over(
            band.count + 1, band.bytes + held.size, limits.max_requests, limits.max_body_bytes
        ):
            victim = band.victim(held) if total.evict else None
            if victim is None:
                return False, victims
            self._take(victim, victims)
        while _over(
            self.count + 1, self.bytes + held.size, total.max_requests, total.max_body_bytes
        ):
            lowest = next(b for b in reversed(self._order) if b.count)
            if not total.evict or lowest.limits.rank < held.band.rank:
                victim = None
            else:
                victim = lowest.victim(held if lowest is band else None)
            if victim is None:
                return False, victims
            self._take(victim, victims)
        held.gone = False
        held.seq = next(self._seq)
        held.position = sum(b.count for b in self._order if b.limits.rank <= held.band.rank)
        band.push(held)
        self.count += 1
        self.bytes += held.size
        heapq.heappush(self._expiry, (held.expires, held.seq, held))
        return True, victims

    def pop(self) -> Held | None:
        """The next request to dispatch: highest band, that band's turn of flows."""
        for band in self._order:
            if band.count:
                held = band.pop()
                self.count -= 1
                self.bytes -= held.size
                held.gone = True
                return held
        return None

    def unpop(self, held: Held) -> None:
        """Put back the request ``pop`` just gave (no pod could take it after all)."""
        held.gone = False
        self._bands[held.band.name].unpop(held)
        self.count += 1
        self.bytes += held.size

    def remove(self, held: Held) -> bool:
        """Take ``held`` out (its client went away); whether it was still held."""
        if held.gone:
            return False
        self._bands[held.band.name].remove(held)
        self.count -= 1
        self.bytes -= held.size
        return True

    def next_expiry(self) -> float | None:
        expiry = self._expiry
        while expiry and expiry[0][2].gone:
            heapq.heappop(expiry)
        return expiry[0][0] if expiry else None

    def expire(self, now: float) -> list[Held]:
        """Take out and return every request held past its band's wait."""
        expired: list[Held] = []
        expiry = self._expiry
        while expiry and (expiry[0][2].gone or expiry[0][0] <= now):
            held = heapq.heappop(expiry)[2]
            if self.remove(held):
                expired.append(held)
        return expired

    def _band(self, limits: BandLimits) -> _Band:
        band = self._bands.get(limits.name)
        if band is None or band.limits.rank != limits.rank:
            if band is None:
                band = self._bands[limits.name] = _Band(limits)
            band.limits = limits  # a reload moved the band: its new rank orders it
            self._order = sorted(self._bands.values(), key=lambda b: b.limits.rank)
        return band

    def _take(self, victim: Held, victims: list[Held]) -> None:
        self.remove(victim)
        victims.append(victim)


def _over(count: int, size: int, max_requests: int | None, max_bytes: int | None) -> bool:
    return (max_requests is not None and count > max_requests) or (
        max_bytes is not None and size > max_bytes
    )
