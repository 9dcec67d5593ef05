"""CEL evaluation speed: policyd's compiler against cel-expr-python and cel-python.

Five representative routing rules, each evaluated the way the policy engine
calls a program: one activation dict reused, ``activation["pod"]`` rebound to
the next candidate pod before every call. Printed: median microseconds per
evaluation for

* policyd   - ``Environment.compile`` (generated Python, params folded);
* cel-cpp    - cel-expr-python (Google's cel-cpp), converting the pod and the
               request to protobuf messages on each call, as policyd's fallback
               does (the pods are Python objects);
* cpp-only   - the same, with the messages built before timing: cel-cpp's
               evaluation and result conversion alone (a lower bound for any
               design that calls it per pod);
* cel-python - the pure-Python ``celpy`` interpreter, its activation converted
               to celpy values before timing (which favours it);

and each one's ratio to policyd, all measured in the same run. Every engine's
answer is checked against policyd's first.

    python benchmarks/cel_eval.py            # about 10 s
    python benchmarks/cel_eval.py --quick    # about 3 s, rougher
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import celpy

from policyd.cel import Environment, cel_type_of, pod_type, request_type
from policyd.cel.fallback import FallbackEvaluator
from policyd.cel.values import Duration
from policyd.policy.request import Request
from policyd.pool.pod import Pod

PARAMS = {"queue_limit": 50, "kv_threshold": 0.8, "queue_weight": 0.5}


@dataclass(frozen=True)
class Rule:
    name: str
    source: str


RULES = (
    Rule(
        "seed (queue + LoRA affinity)",
        "pod.waiting_queue < params.queue_limit && request.model in pod.active_loras",
    ),
    Rule(
        "KV / queue threshold",
        "pod.kv_cache < params.kv_threshold && "
        "pod.waiting_queue + pod.running <= params.queue_limit",
    ),
    Rule(
        "labels / headers map",
        "'zone' in pod.labels && "
        "pod.labels['zone'] == request.headers['x-zone'] && request.criticality != 'sheddable'",
    ),
    Rule(
        "scorer arithmetic (double)",
        "1.0 - (params.queue_weight * double(pod.waiting_queue) "
        "/ double(params.queue_limit) + (1.0 - params.queue_weight) * pod.kv_cache)",
    ),
    Rule("exists over active_loras", "pod.active_loras.exists(l, l.startsWith(request.model))"),
)


def pods() -> list[Pod]:
    return [
        Pod(
            name=f"vllm-{index}",
            address=f"10.0.0.{index}:8000",
            labels={"zone": "a" if index % 2 else "b", "tier": "gpu", "app": "vllm"},
            waiting_queue=index * 7 % 60,
            running=index % 5,
            kv_cache=(index * 0.13) % 1.0,
            active_loras=("sql-lora", "chat-lora", f"lora-{index}")[: 1 + index % 3],
            waiting_loras=("sql-lora",),
            max_loras=4,
            metrics_age=Duration(50_000_000),
        )
        for index in range(8)
    ]


REQUEST = Request(
    model="sql-lora",
    criticality="standard",
    headers={"x-zone": "a", "content-type": "application/json", "x-request-id": "42"},
    prompt_tokens=120,
    max_tokens=256,
)


def median_microseconds(
    evaluate: Callable[[Mapping[str, Any]], Any],
    activation: dict[str, Any],
    candidates: list[Any],
    calls: int,
    repeats: int,
) -> float:
    """Median over ``repeats`` batches of the time of one evaluation, in us.

    A batch walks the candidates as the router does: rebind
    ``activation["pod"]``, evaluate; the loop itself is part of the figure.
    """
    sequence = candidates * max(1, calls // len(candidates))
    for pod in candidates:  # warm up (first-call caches, regex compilation)
        activation["pod"] = pod
        evaluate(activation)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for pod in sequence:
            activation["pod"] = pod
            evaluate(activation)
        samples.append((time.perf_counter() - start) / len(sequence) * 1e6)
    return statistics.median(samples)


def celpy_value(pod: Pod) -> Any:
    return celpy.json_to_cel(
        {
            "name": pod.name,
            "labels": dict(pod.labels),
            "waiting_queue": pod.waiting_queue,
            "running": pod.running,
            "kv_cache": pod.kv_cache,
            "active_loras": list(pod.active_loras),
            "max_loras": pod.max_loras,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter batches")
    options = parser.parse_args()
    scale = 0.2 if options.quick else 1.0

    variables: dict[str, Any] = {
        "pod": pod_type(),
        "request": request_type(),
        "params.queue_limit": cel_type_of("int"),
        "params.kv_threshold": cel_type_of("double"),
        "params.queue_weight": cel_type_of("double"),
    }
    constants = {f"params.{name}": value for name, value in PARAMS.items()}
    environment = Environment(variables)
    celpy_environment = celpy.Environment()
    candidates = pods()
    celpy_candidates = [celpy_value(pod) for pod in candidates]
    celpy_request = celpy.json_to_cel(
        {
            "model": REQUEST.model,
            "criticality": REQUEST.criticality,
            "headers": dict(REQUEST.headers),
        }
    )
    celpy_params = celpy.json_to_cel(PARAMS)

    print(f"median us per evaluation over {len(candidates)} pods (ratio = engine / policyd)")
    columns = ("policyd", "cel-cpp", "cpp-only", "cel-python", "cpp/us", "only/us", "py/us")
    header = f"{'rule':32} " + " ".join(f"{name:>10}" for name in columns)
    print(header)
    print("-" * len(header))
    for rule in RULES:
        program = environment.compile(rule.source, constants=constants)
        assert program.lowered, program.report
        reference = FallbackEvaluator(environment.check(rule.source), variables, constants)
        celpy_program = celpy_environment.program(celpy_environment.compile(rule.source))
        for pod, celpy_pod in zip(candidates, celpy_candidates, strict=True):
            expected = program.evaluate({"pod": pod, "request": REQUEST})
            assert reference({"pod": pod, "request": REQUEST}) == expected, rule.name
            answer = celpy_program.evaluate(
                {"pod": celpy_pod, "request": celpy_request, "params": celpy_params}
            )
            assert answer == expected, (rule.name, answer, expected)

        ours = median_microseconds(
            program.evaluate, {"request": REQUEST}, candidates, int(40_000 * scale), 15
        )
        cpp = median_microseconds(
            reference, {"request": REQUEST}, candidates, int(1_000 * scale), 9
        )
        prebuilt = [reference.convert({"pod": pod, "request": REQUEST}) for pod in candidates]
        converted_evaluate = reference.evaluate_converted
        cpp_only = median_microseconds(
            lambda activation, run=converted_evaluate: run(activation["pod"]),
            {},
            prebuilt,
            int(2_000 * scale),
            9,
        )
        python = median_microseconds(
            celpy_program.evaluate,
            {"request": celpy_request, "params": celpy_params},
            celpy_candidates,
            int(80 * scale),
            7,
        )
        print(
            f"{rule.name:32} {ours:10.3f} {cpp:10.2f} {cpp_only:10.2f} {python:10.1f} "
            f"{cpp / ours:9.0f}x {cpp_only / ours:9.0f}x {python / ours:9.0f}x"
        )


if __name__ == "__main__":
    main()
