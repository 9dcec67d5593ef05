"""Requests without a body: ``GET /v1/models`` and the like.

OpenAI clients list models, and load balancers and dashboards probe servers,
with body-less GET (or HEAD) requests. They name no model, so no routing
policy applies (policies are chosen by model, and their filters read it);
yet a gateway that answers them 400 breaks ``client.models.list()``. So they
go to a ready pod: the candidate with the fewest requests in flight, a tie
broken at random, as a least-request balancer would. Such a pod answers for
itself: vLLM's ``/v1/models`` lists its base model and the adapters it has
loaded, which differ from pod to pod.

Any other method without a body (a POST to ``/v1/completions`` with none) is
still a 400: those are inference requests missing what routing needs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Final

from policyd.policy.decision import Decision, Outcome
from policyd.pool.pod import Pod

METHODS: Final = frozenset({"GET", "HEAD"})
REASON: Final = "no body: the ready pod with the fewest requests in flight"


def least_busy_pod(candidates: Sequence[Pod], rng: random.Random) -> Decision:
    """The routing decision for a body-less request over ``candidates``."""
    if not candidates:
        return Decision(Outcome.NO_CAPACITY, "", "", "", reason="no ready pods")
    fewest = min(pod.in_flight for pod in candidates)
    tied = [pod for pod in candidates if pod.in_flight == fewest]
    pod = tied[rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
    return Decision(
        Outcome.ROUTED,
        "",
        "",
        "",
        endpoint=pod.address,
        pod=pod.name,
        reason=REASON,
        candidates=candidates,
        survivors=tuple(p.name for p in tied),
        chosen=pod,
    )
