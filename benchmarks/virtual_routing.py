"""The real ``Router`` deciding for the simulator's pods in virtual time.

What ``quality.py`` (the seed experiment and the prefix workloads) and
``flow_quality.py`` (flow control's workloads) both route with: the ``Pod``
policyd would publish for a simulated pod, the prefix index ``policyd serve``
builds, and one seed-experiment run routed by a policy file. Both scripts
import this module and neither imports the other's internals, so the
benchmarks hold no import circle (``tests/foundation/test_benchmark_imports.py``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from policyd.cel.values import Duration
from policyd.extproc.openai import REQUEST_ID_HEADER, InferenceBody, parse_body
from policyd.fields.roles import BOTH
from policyd.policy import Decision, Outcome, PolicyStore, Router
from policyd.pool.pod import InFlight, Pod
from policyd.prefix.index import ApproximateIndex, PreciseIndex
from policyd.prefix.options import PrefixSettings
from policyd.prefix.probe import PrefixLocator, PrefixProbe
from policyd.prefix.tokenizers import tokenizer_from_spec
from policyd.sim.bodies import COMPLETIONS_PATH, completion_body, streamed
from policyd.sim.experiment import (
    SEED_PROMPT_TEXT,
    ExperimentResult,
    PodView,
    RoutedRequest,
    SeedWorkload,
    run_experiment,
)
from policyd.sim.profile import L4_LLAMA2_7B, Profile

RULES: Final = Path(__file__).resolve().parents[1] / "rules"
# The published experiment's pods, and the default of every virtual run.
PROFILE: Final = L4_LLAMA2_7B
CRITICAL: Final = MappingProxyType({"x-gateway-inference-criticality": "critical"})
POD_LABELS: Final = MappingProxyType({"app": "vllm"})
SEED_WORKLOAD: Final = SeedWorkload()
FIRST_POD_PORT: Final = 8000  # as `policyd sim --base-port 8000` would serve them
APPROXIMATE: Final = "approximate"
PRECISE: Final = "precise"
# What `policyd serve` tokenizes prompts with unless told otherwise: the seed
# experiment's routing sees the prompt as a live policyd would.
SERVING_TOKENIZER: Final = PrefixSettings().tokenizer


def pod_from_view(
    view: PodView,
    *,
    labels: Mapping[str, str] = POD_LABELS,
    prefix: str | None = None,
    profile: Profile = PROFILE,
    role: str = BOTH,
) -> Pod:
    """The ``Pod`` the service would publish for one simulated pod, as the router saw it.

    Field for field: scraped ``waiting`` / ``running`` / KV use / running and
    waiting adapters / ``max_loras`` / preemptions, the age of that scrape, and policyd's own
    count of requests in flight there (a fresh ``InFlight`` holding the
    simulator's count: the simulator, not this adapter, keeps it up to date);
    the served model and KV-cache geometry from ``profile`` (what the pod's
    ``vllm:cache_config_info`` and ``model_name`` labels say).
    The address is the one ``policyd sim`` would give pod ``i``. ``prefix``
    renames pod ``i`` to ``{prefix}{i}`` (policies that hash pod names, such as
    rendezvous scorers, then see another layout of the same pods). ``role`` is its
    P/D role (``pod.role``), as its role label would give it.
    """
    return Pod(
        name=view.name if prefix is None else f"{prefix}{view.index}",
        address=pod_address(view.index),
        labels=labels,
        role=role,
        waiting_queue=view.waiting,
        running=view.running,
        kv_cache=view.kv_cache_usage,
        active_loras=view.running_adapters,
        waiting_loras=view.waiting_adapters,
        max_loras=view.max_loras,
        num_preemptions=view.preemptions,
        base_model=profile.base_model,
        kv_cache_blocks=profile.num_gpu_blocks,
        kv_block_size=profile.block_size,
        metrics_age=Duration.from_seconds(view.metrics_age),
        load=InFlight(view.in_flight),
    )


def pod_address(index: int) -> str:
    """Where ``policyd sim --base-port 8000`` serves pod ``index``; prefix indexes name it so."""
    return f"127.0.0.1:{FIRST_POD_PORT + index}"


def prefix_locator(
    mode: str, tokenizer: str = "sim", *, profile: Profile = PROFILE
) -> PrefixLocator:
    """A fresh prefix index in ``mode``, as ``policyd serve`` builds one per process.

    Approximate mode bounds each pod's entries by the profile's
    ``num_gpu_blocks`` (what ``vllm:cache_config_info`` tells the serving path).
    """
    index = ApproximateIndex(profile.num_gpu_blocks) if mode == APPROXIMATE else PreciseIndex()
    return PrefixLocator(tokenizer_from_spec(tokenizer), index, profile.block_size)


class NotRoutedError(RuntimeError):
    """The policy answered something other than a pod, which the experiment cannot serve."""


class PolicyRouting:
    """A routing function for ``run_experiment`` that asks the real ``Router``.

    Loads the policy afresh (a round-robin turn is state of the loaded policy,
    so each run starts from the same turn) and seeds the router's generator
    from the experiment's seed, so a run is repeatable. Each request is the
    one ``policyd serve`` reads from what the live client sends
    (``served_request``): the prompt's text, streamed. With a ``locator`` the
    router gets that prompt tokenized as the locator's tokenizer does, so a
    policy reading prefix fields sees what it sees behind ``policyd serve``
    (approximate mode: the seed experiment publishes no KV events).
    """

    def __init__(
        self,
        policy: Path,
        *,
        seed: int,
        headers: Mapping[str, str] = CRITICAL,
        prefix: str | None = None,
        locator: PrefixLocator | None = None,
        prompt: str = SEED_PROMPT_TEXT,
        profile: Profile = PROFILE,
    ) -> None:
        self.router = Router(PolicyStore.open(policy), rng=random.Random(f"policy-{seed}"))
        self.headers = headers
        self.prefix = prefix
        self.profile = profile
        self.locator = locator
        self.prompt = prompt
        self.decisions = 0

    def __call__(self, request: RoutedRequest, views: Sequence[PodView], rng: random.Random) -> int:
        pods = [pod_from_view(view, prefix=self.prefix, profile=self.profile) for view in views]
        body = streamed(completion_body(request.model, self.prompt, request.max_tokens))
        served = served_request(COMPLETIONS_PATH, body, self.headers, request.index)
        probe = self.locator.probe(served.turns) if self.locator is not None else None
        decision = self.router.decide(served.request, pods, probe)
        chosen = routed_index(decision, request.index, views, pods, probe)
        self.decisions += 1
        return chosen


def served_request(
    path: str, body: Mapping[str, Any], headers: Mapping[str, str], index: int
) -> InferenceBody:
    """The request ``policyd serve`` reads from a client's ``body`` (``policyd.sim.bodies``)
    and headers: its own parser's ``Request`` (the prompt's four-characters estimate,
    the budget, the stream flag, the path) and prompt turns, the index as its request id."""
    return parse_body(
        json.dumps(body).encode(), path, headers={**headers, REQUEST_ID_HEADER: str(index)}
    )


def routed_index(
    decision: Decision,
    index: int,
    views: Sequence[PodView],
    pods: Sequence[Pod],
    probe: PrefixProbe | None,
) -> int:
    """The index of the pod ``decision`` routed request ``index`` to; approximate mode
    learns the route."""
    if decision.outcome is not Outcome.ROUTED:
        raise NotRoutedError(
            f"policy '{decision.policy}' answered request {index} with "
            f"{decision.outcome.value} ({decision.outcome.http_status}: {decision.reason}); "
            "the experiment needs every request routed to a pod"
        )
    for view, pod in zip(views, pods, strict=True):
        if pod.name == decision.pod:
            if probe is not None:
                probe.routed(decision.target_model, pod.address)
            return view.index
    raise NotRoutedError(f"policy '{decision.policy}' chose an unknown pod {decision.pod!r}")


def run_policy(
    policy: Path,
    seed: int,
    *,
    workload: SeedWorkload,
    prefix: str | None = None,
    profile: Profile = PROFILE,
    headers: Mapping[str, str] = CRITICAL,
    tokenizer: str | None = None,
) -> ExperimentResult:
    """One virtual run of ``workload`` routed by ``policy`` on pods of ``profile``, each
    request with ``headers``, its prompt tokenized by ``tokenizer`` (``policyd serve``'s
    default when ``None``)."""
    routing = PolicyRouting(
        policy,
        seed=seed,
        headers=headers,
        prefix=prefix,
        locator=prefix_locator(APPROXIMATE, tokenizer or SERVING_TOKENIZER, profile=profile),
        profile=profile,
    )
    return run_experiment(routing, workload=workload, seed=seed, profile=profile)
