"""rules/default.yaml against a direct Python port of the seed scheduler.

The port below follows the Gateway API Inference Extension's original Go
scheduler line by line: ``filter`` structs with ``next_on_success``,
``next_on_failure`` and ``next_on_success_or_failure``, predicate filters that
fail when they keep nothing, and the least-queuing / least-KV-cache filters
with Go's integer division for queue lengths. On thousands of random pool
snapshots and requests the router must end the tree with exactly the same
pods, in the same order, or shed exactly when the port drops the request.

The seed scheduler knows one bit, ``Critical``; policyd's three criticalities
map onto it as the Gateway API Inference Extension's do today (only Sheddable
is shed under load): critical and standard (and a request without the
header) take the seed's critical branch, sheddable its other one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from policyd.policy import Outcome, Router
from policyd.policy.loader import load_policy_set
from policyd.pool.pod import Pod

from .helpers import RULES, request

QUEUEING_THRESHOLD_LORA = 50
QUEUE_THRESHOLD_CRITICAL = 5
KV_CACHE_THRESHOLD = 0.8


class DroppedError(Exception):
    """The port's "drop request" filter: the seed answered 429."""


FilterFunc = Callable[[str, bool, list[Pod]], list[Pod]]


@dataclass
class Filter:
    name: str
    filter: FilterFunc
    next_on_success: Filter | None = None
    next_on_failure: Filter | None = None
    next_on_success_or_failure: Filter | None = None

    def run(self, model: str, critical: bool, pods: list[Pod]) -> list[Pod]:
        filtered = self.filter(model, critical, pods)
        on_success, on_failure = self.next_on_success, self.next_on_failure
        if self.next_on_success_or_failure is not None:
            on_success = on_failure = self.next_on_success_or_failure
        if filtered:
            return filtered if on_success is None else on_success.run(model, critical, filtered)
        # On failure, pass the initial set of pods to the next filter.
        return filtered if on_failure is None else on_failure.run(model, critical, pods)


def predicate(test: Callable[[str, bool, Pod], bool]) -> FilterFunc:
    return lambda model, critical, pods: [p for p in pods if test(model, critical, p)]


def least_queuing(model: str, critical: bool, pods: list[Pod]) -> list[Pod]:
    low = min(p.waiting_queue for p in pods)
    high = max(p.waiting_queue for p in pods)
    return [p for p in pods if low <= p.waiting_queue <= low + (high - low) // len(pods)]


def least_kv_cache(model: str, critical: bool, pods: list[Pod]) -> list[Pod]:
    low = min(p.kv_cache for p in pods)
    high = max(p.kv_cache for p in pods)
    return [p for p in pods if low <= p.kv_cache <= low + (high - low) / len(pods)]


def drop(model: str, critical: bool, pods: list[Pod]) -> list[Pod]:
    raise DroppedError


def lora_affinity(model: str, critical: bool, pod: Pod) -> bool:
    return model in pod.active_loras


def can_accept_new_lora(model: str, critical: bool, pod: Pod) -> bool:
    return len(pod.active_loras) < pod.max_loras


def low_lora_cost(model: str, critical: bool, pod: Pod) -> bool:
    return lora_affinity(model, critical, pod) or can_accept_new_lora(model, critical, pod)


least_kv = Filter("least KV cache percent", least_kv_cache)
queue_lora_and_kv = Filter(
    "least queuing",
    least_queuing,
    next_on_success_or_failure=Filter(
        "low cost LoRA", predicate(low_lora_cost), next_on_success_or_failure=least_kv
    ),
)
queue_and_kv = Filter("least queuing", least_queuing, next_on_success_or_failure=least_kv)
low_latency = Filter(
    "low queueing filter",
    predicate(lambda m, c, p: p.waiting_queue < QUEUEING_THRESHOLD_LORA),
    next_on_success=Filter(
        "affinity LoRA",
        predicate(lora_affinity),
        next_on_success=queue_and_kv,
        next_on_failure=Filter(
            "can accept LoRA Adapter",
            predicate(can_accept_new_lora),
            next_on_success_or_failure=queue_and_kv,
        ),
    ),
    next_on_failure=queue_lora_and_kv,
)
sheddable = Filter(
    "has capacity for sheddable requests",
    predicate(
        lambda m, c, p: (
            p.waiting_queue <= QUEUE_THRESHOLD_CRITICAL and p.kv_cache <= KV_CACHE_THRESHOLD
        )
    ),
    next_on_success=queue_lora_and_kv,
    next_on_failure=Filter("drop request", drop),
)
seed_tree = Filter(
    "critical request",
    predicate(lambda m, critical, p: critical),
    next_on_success=low_latency,
    next_on_failure=sheddable,
)


def seed_schedule(model: str, criticality: str | None, pods: list[Pod]) -> list[str] | None:
    """Names of the pods the seed would pick from; None when it drops the request."""
    critical = (criticality or "").strip().lower() != "sheddable"
    try:
        return [p.name for p in seed_tree.run(model, critical, pods)]
    except DroppedError:
        return None


ADAPTERS = ("sql-lora", "tweet-summary", "chat-lora")


def random_pod(rng: random.Random, index: int) -> Pod:
    queue = rng.choice(
        [rng.randint(0, 8), rng.randint(44, 56), rng.randint(0, 200), rng.choice([0, 5, 6, 50])]
    )
    kv = rng.choice([round(rng.random(), 2), rng.random(), rng.choice([0.0, 0.8, 0.81, 1.0])])
    loras = tuple(a for a in ADAPTERS if rng.random() < 0.35)
    return Pod(
        name=f"pod-{index}",
        address=f"10.0.{index // 250}.{index % 250}:8000",
        waiting_queue=queue,
        kv_cache=kv,
        active_loras=loras,
        max_loras=rng.randint(0, 3),
    )


def test_default_policy_ends_with_the_seed_schedulers_candidates_every_time() -> None:
    rng = random.Random(20240601)
    router = Router(load_policy_set(RULES / "default.yaml"), rng=random.Random(1))
    outcomes = {"routed": 0, "shed": 0}
    for _ in range(2500):
        pods = [random_pod(rng, i) for i in range(rng.randint(1, 10))]
        model = rng.choice([*ADAPTERS, "base-model"])
        criticality = rng.choice(
            ["critical", "standard", "sheddable", None, "Critical ", "Sheddable", "urgent"]
        )
        headers = {"x-gateway-inference-criticality": criticality} if criticality else {}
        decision = router.decide(request(model, headers), pods)
        expected = seed_schedule(model, criticality, pods)
        context = (model, criticality, pods, decision.trace)
        if expected is None:
            assert decision.outcome is Outcome.SHED, context
            assert decision.reason == "dropping request due to limited backend resources"
            outcomes["shed"] += 1
        else:
            assert decision.outcome is Outcome.ROUTED, context
            assert list(decision.survivors) == expected, context
            assert decision.pod in expected
            outcomes["routed"] += 1
    # both halves of the tree were exercised a meaningful number of times
    assert outcomes["shed"] > 200, outcomes
    assert outcomes["routed"] > 1000


def test_no_pods_is_no_capacity_where_the_seed_had_nothing_to_filter() -> None:
    router = Router(load_policy_set(RULES / "default.yaml"))
    decision = router.decide(request("sql-lora"), [])
    assert decision.outcome is Outcome.NO_CAPACITY
    assert decision.outcome.http_status == 503


def test_every_path_of_the_tree_is_taken_by_the_random_snapshots() -> None:
    """The differential run is only as good as its coverage of the tree's paths."""
    rng = random.Random(20240601)
    router = Router(load_policy_set(RULES / "default.yaml"), rng=random.Random(1))
    paths: set[tuple[str, ...]] = set()
    for _ in range(600):
        pods: Sequence[Pod] = [random_pod(rng, i) for i in range(rng.randint(1, 10))]
        model = rng.choice([*ADAPTERS, "base-model"])
        criticality = rng.choice(["critical", "standard", "sheddable"])
        decision = router.decide(
            request(model, {"x-gateway-inference-criticality": criticality}), pods
        )
        paths.add(tuple(t.node for t in decision.trace))
    critical = "sheddable request", "low queueing"
    tails = ("least queuing", "least kv cache")
    assert {
        (*critical, "lora affinity", *tails),
        (*critical, "lora affinity", "can accept adapter", *tails),
        (*critical, "least queuing, then LoRA cost", "low-cost lora", "least kv cache"),
        ("sheddable request", "has capacity", "drop request"),
        (
            "sheddable request",
            "has capacity",
            "least queuing, then LoRA cost",
            "low-cost lora",
            "least kv cache",
        ),
    } <= paths
