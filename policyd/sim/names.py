"""How simulated pods, adapters and P/D roles are named, in one place for all who name them."""

from __future__ import annotations

from typing import Final


def adapter_names(count: int) -> tuple[str, ...]:
    """``adapter-0`` .. ``adapter-{count-1}``: the LoRA adapters every simulated pod serves."""
    return tuple(f"adapter-{i}" for i in range(count))


def pod_name(index: int) -> str:
    """``vllm-{index}``, as a Deployment's pods would be told apart in logs."""
    return f"vllm-{index}"


# llm-d's P/D role label and its values, as a deployment labels its model-server
# pods: the simulator stands in for those pods and writes what they would carry.
ROLE_LABEL: Final = "llm-d.ai/role"
ROLES: Final = ("prefill", "decode", "both")
