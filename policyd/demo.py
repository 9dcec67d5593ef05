"""``policyd demo``: the main job on an embedded default.

The full demo (Envoy + policyd + a simulated vLLM pool) is being built; until
it lands this runs what exists: the seed LoRA-affinity rule, type-checked
against the pod schema and evaluated over a small made-up pool.
"""

from __future__ import annotations

import argparse

from policyd.cel import Environment, cel_type_of, pod_type, request_type
from policyd.policy.request import Request
from policyd.pool.pod import Pod

SEED_RULE = "pod.waiting_queue < params.queue_limit && request.model in pod.active_loras"


def register(name: str, parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=run)


def run(arguments: argparse.Namespace) -> int:
    environment = Environment(
        {"pod": pod_type(), "request": request_type(), "params.queue_limit": cel_type_of("int")}
    )
    program = environment.compile(SEED_RULE, constants={"params.queue_limit": 50})
    pods = (
        Pod("vllm-0", "127.0.0.1:8000", waiting_queue=3, active_loras=("sql-lora", "chat-lora")),
        Pod("vllm-1", "127.0.0.1:8001", waiting_queue=80, active_loras=("sql-lora",)),
        Pod("vllm-2", "127.0.0.1:8002", waiting_queue=0, active_loras=()),
    )
    request = Request(model="sql-lora")
    print(f"rule: {SEED_RULE}   (params.queue_limit = 50, request.model = {request.model!r})")
    for pod in pods:
        verdict = program.evaluate({"pod": pod, "request": request})
        loras = ",".join(pod.active_loras) or "-"
        print(
            f"  {pod.name}  waiting={pod.waiting_queue:<3} loras={loras:<18}"
            f" -> {'keep' if verdict else 'drop'}"
        )
    print("coming next: Envoy + policyd + a simulated vLLM pool, live decisions per request")
    return 0
