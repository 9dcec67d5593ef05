"""A simulated vLLM model server: scheduler engine and OpenAI/Prometheus HTTP front.

No GPU here, so every demo, end-to-end test and benchmark talks to pods that
schedule like vLLM V0 (continuous batching, KV blocks, LoRA slots, prefix
cache) with timings from a calibration profile. The engine is clock-agnostic:
``SimServer`` runs it behind real HTTP in scaled real time, ``run_experiment``
runs it in virtual time. This package imports nothing else of policyd.
"""

from policyd.sim.engine import Engine, EngineSnapshot, RequestState, SimRequest
from policyd.sim.experiment import (
    ExperimentResult,
    PodView,
    RoutedRequest,
    RoutingFunction,
    SeedWorkload,
    run_experiment,
    uniform_random,
)
from policyd.sim.names import adapter_names, pod_name
from policyd.sim.pool import SimPool
from policyd.sim.profile import L4_LLAMA2_7B, PROFILES, Profile, get_profile
from policyd.sim.server import SimServer
from policyd.sim.virtual import VirtualLoop, VirtualPod

__all__ = [
    "L4_LLAMA2_7B",
    "PROFILES",
    "Engine",
    "EngineSnapshot",
    "ExperimentResult",
    "PodView",
    "Profile",
    "RequestState",
    "RoutedRequest",
    "RoutingFunction",
    "SeedWorkload",
    "SimPool",
    "SimRequest",
    "SimServer",
    "VirtualLoop",
    "VirtualPod",
    "adapter_names",
    "get_profile",
    "pod_name",
    "run_experiment",
    "uniform_random",
]
