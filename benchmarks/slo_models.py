"""Which online latency model predicts a pod's TTFT and TPOT best, for its CPU cost.

    python benchmarks/slo_models.py [--seconds 240] [--seed 1]

policyd's simulator (``policyd.sim.open_loop``, virtual time) serves the
shared-prefix workload on 6 pods of the V1 profile ``l4-llama3.1-8b`` at the
knee (7 requests/s) and 1.5x and 2x it, routed at random (so every pod sees
every load). Each request's features are what policyd has when it routes:
the chosen pod's scraped load (queue, running, KV use) and policyd's own
in-flight count there, the prompt's uncached tokens (here the pod's true
cached share, which policyd learns from the answer's ``usage``), its
context. The models are then replayed in virtual time, online: a request is
predicted with what the models learned from the requests that finished
before it arrived, and learned from when it finishes. Reported per load and
family: TTFT and TPOT median absolute percentage error over the requests
after the first 500 (warm-up), and the curve as it learns.

Families:

- ``rls``: ``policyd.latency`` itself, recursive least squares per pod on
  the raw values;
- ``rls-log``: the same learner on the logarithm of the value (a
  multiplicative model);
- ``buckets``: the median of the last 64 outcomes per pod and load bucket
  (queue + in flight, uncached tokens in 512s; TPOT by batch).

Last, the CPU cost of ``LatencyModels.predict_ttft`` over 100 warm pods, the
work a decision that reads ``pod.predicted_ttft_ms`` adds (and with
``predict_tpot``, a policy that reads both), against reading one pod field
of each (the floor of any per-pod work), in the same run.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from policyd.latency.model import WARM, Learner
from policyd.latency.models import (
    TPOT_WIDTH,
    TTFT_WIDTH,
    LatencyModels,
    Outcome,
    tpot_features,
    ttft_features,
)
from policyd.policy.pods import StaticPod
from policyd.sim.experiment import PodView
from policyd.sim.open_loop import Arrival, run_open_loop
from policyd.sim.profile import PROFILES
from policyd.sim.workloads import SharedPrefix

KNEE = 7.0  # shared-prefix's knee on l4-llama3.1-8b (benchmarks/live.py)
WARMUP = 500


@dataclass(frozen=True, slots=True)
class Sample:
    arrived: float
    finished: float
    pod: StaticPod
    in_flight: int
    uncached: int
    context: int
    ttft_ms: float
    tpot_ms: float | None


def simulate(rate: float, seconds: float, seed: int) -> list[Sample]:
    seen: dict[int, tuple[PodView, float]] = {}

    def route(arrival: Arrival, views: Sequence[PodView], rng: random.Random) -> int:
        chosen = rng.randrange(len(views))
        seen[arrival.index] = (views[chosen], arrival.at)
        return chosen

    requests = SharedPrefix().requests(rate=rate, duration_s=seconds, seed=seed)
    result = run_open_loop(route, requests, profile=PROFILES["l4-llama3.1-8b"], seed=seed)
    samples = []
    for record in result.records:
        if not record.completed or record.first_token is None or record.finished is None:
            continue
        view, at = seen[record.index]
        pod = StaticPod(
            view.name,
            f"{view.name}:8000",
            waiting_queue=view.waiting,
            running=view.running,
            kv_cache=view.kv_cache_usage,
            in_flight=view.in_flight,
        )
        tpot = None
        if record.output_tokens > 1:
            tpot = (record.finished - record.first_token) * 1000 / (record.output_tokens - 1)
        samples.append(
            Sample(
                at,
                record.finished,
                pod,
                view.in_flight,
                record.prompt_tokens - (record.cached_tokens or 0),
                record.prompt_tokens + record.output_tokens // 2,
                (record.first_token - at) * 1000,
                tpot,
            )
        )
    return samples


Predictor = Callable[[Sample], tuple[float, float]]
Learn = Callable[[Sample], None]


def family_rls() -> tuple[Predictor, Learn]:
    models = LatencyModels()

    def predict(s: Sample) -> tuple[float, float]:
        pods = (s.pod,)
        return models.predict_ttft(pods, (s.uncached,))[0], models.predict_tpot(pods, s.context)[0]

    def learn(s: Sample) -> None:
        models.learn(Outcome(s.pod, s.in_flight, 0, s.uncached, s.context, s.ttft_ms, s.tpot_ms))

    return predict, learn


def family_rls_log() -> tuple[Predictor, Learn]:
    ttft: dict[str, Learner] = defaultdict(lambda: Learner(TTFT_WIDTH))
    tpot: dict[str, Learner] = defaultdict(lambda: Learner(TPOT_WIDTH))

    def predict(s: Sample) -> tuple[float, float]:
        a, b = ttft[s.pod.name].fit, tpot[s.pod.name].fit
        x = ttft_features(s.uncached, s.pod, s.in_flight, 0)
        y = tpot_features(s.context, s.pod, s.in_flight)
        return (
            math.exp(a.predict(x)) if a.samples >= WARM else -1.0,
            math.exp(b.predict(y)) if b.samples >= WARM else -1.0,
        )

    def learn(s: Sample) -> None:
        ttft[s.pod.name].learn(
            ttft_features(s.uncached, s.pod, s.in_flight, 0), math.log(s.ttft_ms)
        )
        if s.tpot_ms is not None and s.tpot_ms > 0:
            tpot[s.pod.name].learn(
                tpot_features(s.context, s.pod, s.in_flight), math.log(s.tpot_ms)
            )

    return predict, learn


def family_buckets() -> tuple[Predictor, Learn]:
    ttft: dict[tuple[str, int, int], deque[float]] = defaultdict(lambda: deque(maxlen=64))
    tpot: dict[tuple[str, int], deque[float]] = defaultdict(lambda: deque(maxlen=64))

    def keys(s: Sample) -> tuple[tuple[str, int, int], tuple[str, int]]:
        ahead = s.pod.waiting_queue + s.in_flight
        return (s.pod.name, min(ahead, 40) // 2, s.uncached // 512), (s.pod.name, s.pod.running)

    def predict(s: Sample) -> tuple[float, float]:
        a, b = keys(s)
        return (
            statistics.median(ttft[a]) if ttft.get(a) else -1.0,
            statistics.median(tpot[b]) if tpot.get(b) else -1.0,
        )

    def learn(s: Sample) -> None:
        a, b = keys(s)
        ttft[a].append(s.ttft_ms)
        if s.tpot_ms is not None:
            tpot[b].append(s.tpot_ms)

    return predict, learn


FAMILIES = {"rls": family_rls, "rls-log": family_rls_log, "buckets": family_buckets}


def replay(samples: list[Sample], family: str) -> tuple[list[float], list[float], int]:
    """Absolute percentage errors (TTFT, TPOT) of the requests after warm-up, and how
    many of those had no prediction."""
    predict, learn = FAMILIES[family]()
    events: list[tuple[float, int, int]] = []
    for i, s in enumerate(samples):
        events.append((s.arrived, 1, i))
        events.append((s.finished, 0, i))  # at equal times a finish teaches first
    events.sort()
    predicted: dict[int, tuple[float, float]] = {}
    for _, kind, i in events:
        if kind == 1:
            predicted[i] = predict(samples[i])
        else:
            learn(samples[i])
    order = sorted(range(len(samples)), key=lambda i: samples[i].arrived)[WARMUP:]
    ttft_errors, tpot_errors, cold = [], [], 0
    for i in order:
        p_ttft, p_tpot = predicted[i]
        s = samples[i]
        if p_ttft < 0:
            cold += 1
            continue
        ttft_errors.append(abs(p_ttft - s.ttft_ms) / s.ttft_ms * 100)
        if s.tpot_ms is not None and s.tpot_ms > 0 and p_tpot >= 0:
            tpot_errors.append(abs(p_tpot - s.tpot_ms) / s.tpot_ms * 100)
    return ttft_errors, tpot_errors, cold


def learning_curve(errors: list[float], chunk: int = 250) -> str:
    return " ".join(
        f"{statistics.median(errors[i : i + chunk]):.0f}"
        for i in range(0, len(errors), chunk)
        if errors[i : i + chunk]
    )


def prediction_cost(rounds: int = 2000) -> tuple[float, float, float]:
    """Microseconds per decision: predicting 100 warm pods' TTFT, their TTFT and TPOT,
    and reading one field of each."""
    rng = random.Random(7)
    models = LatencyModels()
    pods = [
        StaticPod(f"pod-{i}", f"10.0.0.{i}:8000", waiting_queue=i % 5, running=i % 9)
        for i in range(100)
    ]
    for pod in pods:
        for _ in range(WARM + 4):
            models.learn(Outcome(pod, rng.randrange(8), 0, 800, 1200, rng.uniform(50, 500), 30.0))

    def per_decision(work: Callable[[], object]) -> float:
        started = time.perf_counter()
        for _ in range(rounds):
            work()
        return (time.perf_counter() - started) / rounds * 1e6

    uncached = [800] * len(pods)
    floor = per_decision(lambda: [pod.running for pod in pods])
    ttft = per_decision(lambda: models.predict_ttft(pods, uncached))
    both = per_decision(
        lambda: (models.predict_ttft(pods, uncached), models.predict_tpot(pods, 1200))
    )
    return ttft, both, floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print("| load | requests | family | TTFT MdAPE | TPOT MdAPE | cold | TTFT curve (per 250) |")
    print("|---|---|---|---|---|---|---|")
    for factor in (1.0, 1.5, 2.0):
        samples = simulate(KNEE * factor, args.seconds, args.seed)
        for family in FAMILIES:
            ttft, tpot, cold = replay(samples, family)
            print(
                f"| {factor:g}x knee | {len(samples)} | {family} "
                f"| {statistics.median(ttft) if ttft else float('nan'):.1f}% "
                f"| {statistics.median(tpot) if tpot else float('nan'):.1f}% "
                f"| {cold} | {learning_curve(ttft)} |"
            )
    ttft, both, floor = prediction_cost()
    print(
        f"\nTTFT over 100 pods: {ttft:.1f} us per decision (with TPOT: {both:.1f} us);"
        f" reading one field of each: {floor:.1f} us ({ttft / floor:.1f}x);"
        f" added: {ttft - floor:.1f} us"
    )


if __name__ == "__main__":
    main()
