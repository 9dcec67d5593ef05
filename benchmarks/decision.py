"""Decision latency of the shipped policies next to hand-written Python doing the same work.

For ``rules/default.yaml`` (the seed LoRA-affinity tree) and ``rules/scorers.yaml``
at 10, 100 and 1000 pods, it times ``Router.decide`` and a plain Python function
that makes the same decision (same filters, same bands, same scores, same pick),
on the same pool and the same requests, in the same run. The ratio of the two
p50s is the overhead of the rule language: CEL evaluation plus the tree walk,
the per-node trace and the Decision object.

    python benchmarks/decision.py                      # about 15 s
    python benchmarks/decision.py --budget 1 --sizes 10,100

The goal for the default policy is p50 <= 100 us at 100 pods; the CEL line at
the top says which evaluator served the run (the fast lowering compiler, or
the cel-expr-python fallback that is two orders of magnitude slower).

"policyd p50" walks the filter tree on every decision (the pool passed as a
list, which the router never reuses a walk for). "served p50" is what the
service sees: the pool arrives as a tuple that is replaced every
``--per-snapshot`` requests (50: 500 requests/s over a pool scraped 10 times
a second), so a walk is reused by the requests with the same criticality and
target model until the next snapshot, and scoring and picking still run each
time.

``--pd`` instead times a two-stage decision (``rules/pd.yaml``: the decode
pod, ``when``, the prefill pod) against the single-stage one it extends
(``rules/lora-prefix.yaml``, the same scorers over every pod) on the same
pool, half of it ``decode`` pods and half ``prefill`` pods, and the same
requests: all long (every one split: both stages run) and all short (none
split: the decode stage and ``when``). The goal is a ratio of at most 2. The
last column compares with the single stage over the decode pods alone: what
``when`` and the prefill stage add to the decode stage.

    python benchmarks/decision.py --pd --sizes 10,100

``--slo`` times ``rules/slo.yaml`` (``rules/lora-prefix.yaml`` reading the
predicted latencies) against ``rules/lora-prefix.yaml`` on the same pool and
the same requests, half of them stating a TTFT objective
(``x-llm-d-slo-ttft-ms``) and half not, every pod's latency models warm
(taught by the serving path's ``Learning`` sink), every policy given each
pod's prefix match for the prompt as the service gives it (a fixed one per
pod: the index's own cost is the same for all and left out). Beside them,
``rules/default.yaml`` (the decision budget's reference) and slo.yaml
without models (every pod "no prediction"), whose difference from slo.yaml
is what predicting costs. They take turns, ``--rounds`` each, in one
process, over the pool as a list (the walk made every time). The goal
(issue 35, a policy that reads predictions adds at most 50 us): predicting
costs at most 50 us p50 at 100 pods.

    python benchmarks/decision.py --slo --sizes 10,100
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from policyd.cel import Environment, pod_type
from policyd.extproc.openai import SLO_TTFT_HEADERS, slo_of
from policyd.fields.prefix_match import PrefixMatch
from policyd.latency.learning import Learning
from policyd.latency.model import WARM
from policyd.latency.models import COLD, LatencyModels
from policyd.policy import Outcome, Request, Router
from policyd.policy.loader import load_policy_set
from policyd.policy.pods import PolicyPod
from policyd.pool.pod import Pod
from policyd.telemetry.exchange_end import ExchangeEnd

RULES = Path(__file__).resolve().parents[1] / "rules"
HEADER = "x-gateway-inference-criticality"
ADAPTERS = [f"lora-{i}" for i in range(8)]


def make_pool(size: int, rng: random.Random) -> list[Pod]:
    """A pool under moderate load: short queues mostly, a few long ones, some adapters."""
    pods = []
    for i in range(size):
        queue = rng.choice([rng.randint(0, 6), rng.randint(0, 20), rng.randint(30, 80)])
        pods.append(
            Pod(
                name=f"vllm-{i}",
                address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000",
                waiting_queue=queue,
                running=rng.randint(0, 32),
                kv_cache=round(rng.random(), 3),
                active_loras=tuple(rng.sample(ADAPTERS, rng.randint(0, 3))),
                max_loras=4,
            )
        )
    return pods


def make_requests(count: int, rng: random.Random) -> list[Request]:
    criticalities = ["critical", "critical", "standard", "sheddable"]
    return [
        Request(
            model=rng.choice(ADAPTERS),
            headers={HEADER: rng.choice(criticalities)},
        )
        for _ in range(count)
    ]


# --- the same decisions, written by hand -------------------------------------------------


def _band(pods: list[Pod], value: Callable[[Pod], float]) -> list[Pod]:
    values = [value(p) for p in pods]
    low = min(values)
    limit = low + (max(values) - low) / len(pods)
    return [p for p, v in zip(pods, values, strict=True) if v <= limit]


def _queue(p: Pod) -> float:
    return p.waiting_queue


def _kv(p: Pod) -> float:
    return p.kv_cache


def hand_default(request: Request, pods: list[Pod], rng: random.Random) -> Pod | None:
    """rules/default.yaml in plain Python (None: shed)."""
    target = request.model
    critical = request.headers.get(HEADER, "").strip().lower() == "critical"
    if critical:
        low = [p for p in pods if p.waiting_queue < 50]
        if low:
            with_adapter = [p for p in low if target in p.active_loras]
            free_slot = with_adapter or [p for p in low if len(p.active_loras) < p.max_loras]
            chosen = with_adapter or free_slot or low
            survivors = _band(_band(chosen, _queue), _kv)
            return survivors[rng.randrange(len(survivors))]
        start = pods
    else:
        start = [p for p in pods if p.waiting_queue <= 5 and p.kv_cache <= 0.8]
        if not start:
            return None
    queued = _band(start, _queue)
    cheap = [p for p in queued if target in p.active_loras or len(p.active_loras) < p.max_loras]
    survivors = _band(cheap or queued, _kv)
    return survivors[rng.randrange(len(survivors))]


def hand_scorers(request: Request, pods: list[Pod], rng: random.Random) -> Pod | None:
    """rules/scorers.yaml in plain Python: clamped weighted scores, best + 2 fallbacks."""
    target = request.model
    totals = []
    for p in pods:
        queue = min(max(1.0 - p.waiting_queue / 50.0, 0.0), 1.0)
        kv = min(max(1.0 - p.kv_cache, 0.0), 1.0)
        if target in p.active_loras:
            lora = 1.0
        elif len(p.active_loras) < p.max_loras:
            lora = 0.5
        else:
            lora = 0.0
        totals.append(2 * queue + kv + 1.5 * lora)
    best = max(totals)
    tied = [i for i, t in enumerate(totals) if t == best]
    chosen = tied[rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
    rest = sorted((i for i in range(len(pods)) if i != chosen), key=totals.__getitem__)[-2:]
    _ = [pods[i].address for i in rest]
    return pods[chosen]


# --- measuring ---------------------------------------------------------------------------


def measure(
    decide: Callable[[Request], Any], requests: Sequence[Request], budget: float
) -> list[float]:
    """Latencies in microseconds, cycling through ``requests`` for ``budget`` seconds
    (at least 20 and at most 20,000 samples)."""
    for request in requests[:3]:
        decide(request)  # warm caches
    samples: list[float] = []
    deadline = time.perf_counter() + budget
    index = 0
    while (time.perf_counter() < deadline or len(samples) < 20) and len(samples) < 20_000:
        request = requests[index % len(requests)]
        index += 1
        start = time.perf_counter_ns()
        decide(request)
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


Hand = Callable[[Request, list[Pod], random.Random], Pod | None]


def compare(
    router: Router,
    hand: Hand,
    pods: list[Pod],
    requests: Sequence[Request],
    *,
    budget: float,
    per_snapshot: int,
) -> tuple[list[float], list[float], list[float]]:
    """Latencies of the router walking every time, of the router as served (snapshots
    replaced every ``per_snapshot`` decisions) and of the hand-written function."""
    hand_rng = random.Random(1)
    ours = measure(lambda r: router.decide(r, pods), requests, budget / 3)
    served = measure(served_by(router, pods, per_snapshot), requests, budget / 3)
    theirs = measure(lambda r: hand(r, pods, hand_rng), requests, budget / 3)
    return ours, served, theirs


def served_by(router: Router, pods: list[Pod], per_snapshot: int) -> Callable[[Request], Any]:
    """Decide as the service does: over a tuple the pool replaces now and then."""
    snapshot = tuple(pods)
    decided = 0

    def decide(request: Request) -> Any:
        nonlocal snapshot, decided
        decided += 1
        if decided % per_snapshot == 0:
            snapshot = tuple(pods)  # the next scrape round's snapshot: new walks
        return router.decide(request, snapshot)

    return decide


def p50_p99(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def evaluations_per_decision(router: Router, requests: Sequence[Request], pods: list[Pod]) -> float:
    """CEL evaluations one decision makes on average (pods entering pod-level nodes,
    plus one per scorer and survivor): the figure to multiply by the per-eval cost."""
    policy = router.store.current.policies[0]
    total = 0
    for request in requests:
        decision = router.decide(request, pods)
        for step in decision.trace:
            if step.narrows:  # keep, band, top_k: once per pod entering
                total += step.candidates_in
            elif step.kind == "if":
                total += 1
        if decision.outcome is Outcome.ROUTED and policy.picker.uses_scores:
            total += len(policy.scorers) * len(decision.survivors)
    return total / len(requests)


def pd_comparison(sizes: Sequence[int], budget: float) -> None:
    """Two-stage decisions (rules/pd.yaml) against single-stage ones (lora-prefix.yaml)."""
    single = Router(load_policy_set(RULES / "lora-prefix.yaml"), rng=random.Random(1))
    split = Router(load_policy_set(RULES / "pd.yaml"), rng=random.Random(1))
    print(
        f"{'prompts':<8}{'pods':>6}  {'one stage p50':>14}{'p99':>10}  {'P/D p50':>10}{'p99':>10}"
        f"  {'ratio p50':>9}  {'split':>6}  {'vs decode pods only':>19}"
    )
    for size in sizes:
        rng = random.Random(size)
        pods = [
            dataclasses.replace(pod, role="decode" if index % 2 else "prefill")
            for index, pod in enumerate(make_pool(size, rng))
        ]
        for label, tokens in (("long", 6000), ("short", 100)):
            requests = [
                dataclasses.replace(r, prompt_tokens=tokens) for r in make_requests(200, rng)
            ]
            ones = measure(lambda r, p=pods: single.decide(r, p), requests, budget / 3)
            twos = measure(lambda r, p=pods: split.decide(r, p), requests, budget / 3)
            # The single stage over the decode pods alone: what the second stage adds.
            decoders = [pod for pod in pods if pod.role == "decode"]
            halves = measure(lambda r, p=decoders: single.decide(r, p), requests, budget / 3)
            splits = [split.decide(r, pods).split for r in requests[:50]]
            share = sum(1 for s in splits if s is not None and s.split) / len(splits)
            one_p50, one_p99 = p50_p99(ones)
            two_p50, two_p99 = p50_p99(twos)
            print(
                f"{label:<8}{size:>6}  {one_p50:>11.1f} us{one_p99:>7.0f} us  "
                f"{two_p50:>7.1f} us{two_p99:>7.0f} us  {two_p50 / one_p50:>8.2f}x  {share:>6.0%}"
                f"  {two_p50 / p50_p99(halves)[0]:>18.2f}x"
            )


class FixedPrefix:
    """A prompt's prefix match on each pod of one pool, the same for every request
    (``policyd.prefix``'s probe, without its cost)."""

    def __init__(self, pods: Sequence[Pod], rng: random.Random) -> None:
        self.matches = [
            PrefixMatch(share, round(share * 2000))
            for share in (rng.choice([0.0, 0.0, rng.random()]) for _ in pods)
        ]

    def match(self, model: str, pods: Sequence[PolicyPod]) -> Sequence[PrefixMatch]:
        return self.matches


def slo_requests(count: int, rng: random.Random) -> list[Request]:
    """``make_requests`` with prompts, answers and half of them a TTFT objective, read
    from the header as the serving path reads it."""
    requests = []
    for index, request in enumerate(make_requests(count, rng)):
        headers = dict(request.headers)
        if index % 2:
            headers[SLO_TTFT_HEADERS[0]] = str(rng.choice([500, 1000, 2000]))
        requests.append(
            dataclasses.replace(
                request,
                headers=headers,
                prompt_tokens=rng.randint(100, 4000),
                max_tokens=rng.randint(16, 512),
                stream=True,
                slo_ttft_ms=slo_of(headers, SLO_TTFT_HEADERS),
            )
        )
    return requests


def warm_models(
    router: Router, models: LatencyModels, pods: Sequence[Pod], rng: random.Random
) -> None:
    """Teach every pod's models as the service does, through its ``Learning`` sink:
    ``WARM`` + 4 streamed answers each, routed there, the first token later the more
    the pod queues and the longer the prompt."""
    sink = Learning(models)
    for pod in pods:
        for _ in range(WARM + 4):
            request = Request(
                model=rng.choice(ADAPTERS), prompt_tokens=rng.randint(100, 4000), stream=True
            )
            decision = router.decide(request, [pod])
            first = 0.05 + 0.01 * pod.waiting_queue + 0.0001 * request.prompt_tokens
            first *= rng.uniform(0.8, 1.2)
            tokens = rng.randint(2, 300)
            duration = first + tokens * 0.02 * rng.uniform(0.8, 1.2)
            end = ExchangeEnd(True, duration, first, request.prompt_tokens, tokens)
            sink.start(request, decision, {}, 0.0).end(end)
    cold = [
        p.name
        for p, ttft in zip(pods, models.predict_ttft(pods, [0] * len(pods)), strict=True)
        if ttft == COLD
    ]
    if cold:  # a cold pod skips the work this measures
        raise SystemExit(f"no prediction after warming: {', '.join(cold)}")


def slo_comparison(sizes: Sequence[int], budget: float, rounds: int) -> None:
    """rules/slo.yaml on warm models against rules/lora-prefix.yaml; beside them
    default.yaml and slo.yaml without models (every field "no prediction"), whose
    difference from slo.yaml is what predicting costs."""
    models = LatencyModels()
    routers = {
        "default": Router(load_policy_set(RULES / "default.yaml"), rng=random.Random(1)),
        "lora-prefix": Router(load_policy_set(RULES / "lora-prefix.yaml"), rng=random.Random(1)),
        "slo": Router(load_policy_set(RULES / "slo.yaml"), rng=random.Random(1), latency=models),
        "cold": Router(load_policy_set(RULES / "slo.yaml"), rng=random.Random(1)),
    }
    print(
        f"{'pods':>6}  {'default p50':>11}  {'lora-prefix p50':>15}  {'slo p50':>9}"
        f"  {'slo - lora-prefix':>17}  {'ratio':>6}  {'slo, no models':>14}  {'predicting':>10}"
    )
    for size in sizes:
        rng = random.Random(size)
        pods = make_pool(size, rng)
        for pod in pods:  # policyd's own load there, which the predictions read
            pod.load.count = rng.randint(0, 8)
            pod.load.prefill_tokens = rng.choice([0, 0, rng.randint(100, 4000)])
        warm_models(routers["slo"], models, pods, rng)
        requests = slo_requests(200, rng)
        prompt = FixedPrefix(pods, rng)
        samples: dict[str, list[float]] = {name: [] for name in routers}
        for _ in range(rounds):  # in turn, so that the machine's load falls on each alike
            for name, router in routers.items():
                samples[name] += measure(
                    lambda r, d=router.decide, p=pods, m=prompt: d(r, p, m),
                    requests,
                    budget / rounds,
                )
        default, single, slo, cold = (p50_p99(samples[name])[0] for name in routers)
        print(
            f"{size:>6}  {default:>8.1f} us  {single:>12.1f} us  {slo:>6.1f} us"
            f"  {slo - single:>14.1f} us  {slo / single:>5.2f}x  {cold:>11.1f} us"
            f"  {slo - cold:>7.1f} us"
        )


def cel_backend() -> str:
    program = Environment({"pod": pod_type()}).compile("pod.waiting_queue < 50")
    if program.lowered:
        return "lowered to Python closures (fast compiler)"
    return "cel-expr-python fallback (not lowered): " + "; ".join(program.report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100,1000", help="pool sizes (default 10,100,1000)")
    parser.add_argument(
        "--budget", type=float, default=4.0, help="seconds per measurement (default 4)"
    )
    parser.add_argument(
        "--per-snapshot",
        type=int,
        default=50,
        help="decisions per pool snapshot in the 'served' column (default 50)",
    )
    parser.add_argument(
        "--pd",
        action="store_true",
        help="time a two-stage (prefill/decode) decision against a single-stage one instead",
    )
    parser.add_argument(
        "--slo",
        action="store_true",
        help="time rules/slo.yaml (warm latency models) against rules/lora-prefix.yaml instead",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="turns each policy takes with --slo (default 5)"
    )
    arguments = parser.parse_args()
    sizes = [int(s) for s in arguments.sizes.split(",")]
    print(f"CEL: {cel_backend()}")
    if arguments.pd:
        pd_comparison(sizes, arguments.budget)
        return
    if arguments.slo:
        slo_comparison(sizes, arguments.budget, arguments.rounds)
        return
    print(
        f"{'policy':<9}{'pods':>6}  {'policyd p50':>12}{'p99':>10}  {'served p50':>11}"
        f"{'p99':>10}  {'python p50':>11}{'p99':>10}  {'ratio p50':>9}  {'evals/decision':>14}"
    )
    policies: list[tuple[str, Hand]] = [
        ("default", hand_default),
        ("scorers", hand_scorers),
    ]
    for name, hand in policies:
        router = Router(load_policy_set(RULES / f"{name}.yaml"), rng=random.Random(1))
        for size in sizes:
            rng = random.Random(size)
            pods = make_pool(size, rng)
            requests = make_requests(200, rng)
            ours, served, theirs = compare(
                router,
                hand,
                pods,
                requests,
                budget=arguments.budget,
                per_snapshot=arguments.per_snapshot,
            )
            ours_p50, ours_p99 = p50_p99(ours)
            served_p50, served_p99 = p50_p99(served)
            hand_p50, hand_p99 = p50_p99(theirs)
            evals = evaluations_per_decision(router, requests[:50], pods)
            print(
                f"{name:<9}{size:>6}  {ours_p50:>9.1f} us{ours_p99:>7.0f} us  "
                f"{served_p50:>8.1f} us{served_p99:>7.0f} us  "
                f"{hand_p50:>8.1f} us{hand_p99:>7.0f} us  {ours_p50 / hand_p50:>8.1f}x  "
                f"{evals:>14.0f}"
            )


if __name__ == "__main__":
    main()
