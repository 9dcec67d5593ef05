"""What is in flight under flow control: per pod its KV estimate, per flow and band its count.

``FlowControl`` (``control.py``) reads a pod through this: the tokens the
requests it sent there hold (``Footprint``), and what changed since the
pool's last snapshot. It also tells where a request stands:

- **Under its share**: its flow has fewer requests in flight than its
  weight's share of its policy's, over the flows in flight and its own. Such
  a request reads a pod's cache as scraped plus what the scrape has not seen
  yet (``unseen.py``), not as the larger of that and the estimate.
- **Keeping a reserve**: a request leaves room on each pod for one average
  request (the decayed mean of the estimates) when one could go before it: a
  request of a higher band of its policy is in flight, or it is at or over
  its share while another flow is in flight. So a pod paced to the
  saturation limit by a flood or by lower bands still has room for the
  next critical request or the small tenant's, and they do not wait for a
  request to end.

A request counts under the flow ``FlowControl`` placed it in (its key, or the
overflow flow past the policy's ``max_flows``, of weight 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from policyd.flow.footprint import DecayedMean, Footprint
from policyd.policy.request import Request
from policyd.policy.router import Admission


@dataclass(frozen=True, slots=True)
class _Flying:
    pod: str
    flow: tuple[str, str]  # (policy, flow key)
    rank: int  # the band's
    tokens: int
    request: Request


class _Policy:
    """One policy's requests in flight: their count, the weights of its flows in
    flight, and the count per band rank."""

    __slots__ = ("count", "flows", "ranks", "weights")

    def __init__(self) -> None:
        self.count = 0
        self.flows = 0  # flows in flight
        self.weights = 0.0
        self.ranks: dict[int, int] = {}


class Flight:
    """The requests under flow control in flight (see the module docstring)."""

    def __init__(self) -> None:
        self.footprint = Footprint()
        self.tokens: dict[str, int] = {}  # per pod
        self.counts: dict[str, int] = {}  # per pod: the requests in flight there
        self._mean = DecayedMean(0.0)  # tokens per request dispatched
        self._flying: dict[object, _Flying] = {}
        self._flows: dict[tuple[str, str], list[float]] = {}  # [count, weight]
        self._policies: dict[str, _Policy] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._flying

    def __bool__(self) -> bool:
        return bool(self._flying)

    @property
    def reserve(self) -> float:
        """The room a request keeps for one that could go before it: the mean estimate."""
        return self._mean.value

    def flows(self, policy: str) -> int:
        """How many flows of ``policy`` have requests in flight."""
        found = self._policies.get(policy)
        return found.flows if found is not None else 0

    def carries(self, policy: str, flow: str) -> bool:
        """Whether ``flow`` of ``policy`` has requests in flight."""
        return (policy, flow) in self._flows

    def fly(self, key: object, pod: str, admission: Admission, flow_key: str) -> int:
        """The request of ``key`` (under ``admission``, in the flow ``flow_key``) went
        to ``pod``; the tokens it is estimated to hold there."""
        request = admission.request
        tokens = self.footprint.tokens(request.prompt_tokens, request.max_tokens)
        self._mean.add(tokens)
        flow = (admission.policy, flow_key)
        self.land(key)  # a key is in flight once
        rank = admission.band.rank
        self._flying[key] = _Flying(pod, flow, rank, tokens, request)
        self.tokens[pod] = self.tokens.get(pod, 0) + tokens
        self.counts[pod] = self.counts.get(pod, 0) + 1
        policy = self._policies.get(admission.policy)
        if policy is None:
            policy = self._policies[admission.policy] = _Policy()
        counted = self._flows.get(flow)
        if counted is None:
            weight = weight_in(admission, flow_key)
            self._flows[flow] = [1.0, weight]
            policy.weights += weight
            policy.flows += 1
        else:
            counted[0] += 1
        policy.count += 1
        policy.ranks[rank] = policy.ranks.get(rank, 0) + 1
        return tokens

    def land(self, key: object) -> Request | None:
        """The request of ``key`` is no longer in flight; it (None: it was not)."""
        flying = self._flying.pop(key, None)
        if flying is None:
            return None
        pod, flow = flying.pod, flying.flow
        if self.counts[pod] > 1:
            self.tokens[pod] -= flying.tokens
            self.counts[pod] -= 1
        else:
            del self.tokens[pod], self.counts[pod]
        counted = self._flows[flow]
        policy = self._policies[flow[0]]
        counted[0] -= 1
        if not counted[0]:
            del self._flows[flow]
            policy.weights -= counted[1]
            policy.flows -= 1
        policy.count -= 1
        if not policy.count:
            del self._policies[flow[0]]
        else:
            ranks = policy.ranks
            ranks[flying.rank] -= 1
            if not ranks[flying.rank]:
                del ranks[flying.rank]
        return flying.request

    def standing(self, admission: Admission, flow_key: str) -> tuple[bool, bool]:
        """Whether the request (in the flow ``flow_key``) is under its flow's share, and
        whether it keeps the reserve (see the module docstring)."""
        policy = self._policies.get(admission.policy)
        if policy is None:
            return True, False
        rank = admission.band.rank
        higher = any(other < rank for other in policy.ranks)
        counted = self._flows.get((admission.policy, flow_key))
        if counted is None:
            return True, higher  # nothing of its flow in flight: under any share
        under = counted[0] < policy.count * counted[1] / policy.weights
        return under, higher or (not under and policy.weights > counted[1])


def weight_in(admission: Admission, flow_key: str) -> float:
    """The weight of the request's flow: its own in its own flow, 1 in the overflow flow."""
    return admission.weight if flow_key == admission.key else 1.0
