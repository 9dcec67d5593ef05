"""How simulated pods and adapters are named, in one place for servers and experiments."""

from __future__ import annotations


def adapter_names(count: int) -> tuple[str, ...]:
    """``adapter-0`` .. ``adapter-{count-1}``: the LoRA adapters every simulated pod serves."""
    return tuple(f"adapter-{i}" for i in range(count))


def pod_name(index: int) -> str:
    """``vllm-{index}``, as a Deployment's pods would be told apart in logs."""
    return f"vllm-{index}"
