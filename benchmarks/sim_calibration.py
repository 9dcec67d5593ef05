"""The seed experiment in virtual time: random routing (baseline) against LoRA affinity.

Runs the published seed workload (1000 requests, 100 connections, 12 adapters,
6 pods of ``l4-llama2-7b``, 300 s per request) on the simulator for several
seeds and three routing functions:

- uniform random: what a Kubernetes Service does (the calibration baseline,
  published as 484 completed requests and 640 output tokens/s);
- LoRA affinity: a simple router in the spirit of the seed policy, working
  from metrics scraped every 100 ms (published: 846 completed, 1127 tokens/s);
- adapter partition: adapter ``i`` always to pod ``i mod 6``, a static
  assignment no router could know in advance, shown as the ceiling of what
  adapter-aware routing can gain on these pods.

Figures are printed as ratios to the random baseline of the same run, next to
the published ratio.

    python benchmarks/sim_calibration.py            # 5 seeds, a few seconds
    python benchmarks/sim_calibration.py --seeds 20
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

from policyd.sim.experiment import (
    ExperimentResult,
    PodView,
    RoutedRequest,
    RoutingFunction,
    run_experiment,
    uniform_random,
)
from policyd.sim.profile import PROFILES, get_profile

PUBLISHED = {"uniform random": (484, 640), "LoRA affinity": (846, 1127)}
QUEUE_LIMIT = 50


def lora_affinity(request: RoutedRequest, pods: Sequence[PodView], rng: random.Random) -> int:
    """Pods already serving the adapter with a short queue; else pods with a free
    adapter slot; else the shortest queue. Ties go to the fewest requests in flight."""
    short = [pod for pod in pods if pod.waiting < QUEUE_LIMIT]
    affine = [
        pod
        for pod in short
        if request.model in pod.running_adapters or request.model in pod.waiting_adapters
    ]
    if not affine:
        affine = [
            pod
            for pod in short
            if len({*pod.running_adapters, *pod.waiting_adapters}) < pod.max_loras
        ]
    candidates = affine or list(pods)
    return min(candidates, key=lambda pod: (pod.waiting, pod.in_flight, pod.index)).index


def adapter_partition(request: RoutedRequest, pods: Sequence[PodView], rng: random.Random) -> int:
    """adapter-i always to pod i mod len(pods): a static ideal, not a router."""
    return int(request.model.rsplit("-", 1)[1]) % len(pods)


ROUTERS: dict[str, RoutingFunction] = {
    "uniform random": uniform_random,
    "LoRA affinity": lora_affinity,
    "adapter partition": adapter_partition,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per router (default 5)")
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="l4-llama2-7b",
        help="the simulated pods (default %(default)s, the one the published figures calibrate)",
    )
    arguments = parser.parse_args()
    seeds = range(arguments.seeds)
    profile = get_profile(arguments.profile)
    results: dict[str, list[ExperimentResult]] = {}
    began = time.perf_counter()
    for name, route in ROUTERS.items():
        results[name] = [run_experiment(route, seed=seed, profile=profile) for seed in seeds]
    wall = time.perf_counter() - began
    baseline = results["uniform random"]
    base_completed = statistics.mean(r.completed for r in baseline)
    base_tokens = statistics.mean(r.output_tokens_per_s for r in baseline)
    print(
        f"seed experiment on {profile.name}, {len(seeds)} seeds per router, "
        f"{len(ROUTERS) * len(seeds) * 300} simulated s in {wall:.1f} s of wall time"
    )
    print(
        f"{'router':<18} {'completed':>15} {'tokens/s':>13} {'TTFT p50 s':>10} "
        f"{'vs random':>10}   published (vs random)"
    )
    for name, runs in results.items():
        completed = [r.completed for r in runs]
        tokens = [r.output_tokens_per_s for r in runs]
        ttft = statistics.median(statistics.median(r.ttft_s()) for r in runs)
        ratio = statistics.mean(completed) / base_completed
        token_ratio = statistics.mean(tokens) / base_tokens
        published = PUBLISHED.get(name)
        reference = (
            f"{published[0]} / {published[1]} "
            f"({published[0] / PUBLISHED['uniform random'][0]:.2f}x)"
            if published
            else "-"
        )
        print(
            f"{name:<18} {statistics.mean(completed):7.0f} +- {_spread(completed):4.0f} "
            f"{statistics.mean(tokens):6.0f} +- {_spread(tokens):3.0f} {ttft:10.2f} "
            f"{ratio:5.2f}/{token_ratio:.2f}x   {reference}"
        )


def _spread(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


if __name__ == "__main__":
    main()
