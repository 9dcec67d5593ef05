"""Calibration profiles: the constants that make a simulated pod behave like one GPU.

Everything the scheduler rules need in numbers lives here and nowhere else, so a
calibration changes a profile and never the rules. A profile also names the
scheduler it runs: ``v0`` (vLLM V0 without chunked prefill, ``engine.py``) or
``v1`` (vLLM V1: chunked prefill under a token budget, ``engine_v1.py``).

``h100-llama3.1-8b`` is Llama-3.1-8B-Instruct on one H100 80GB under vLLM V1
defaults; its constants and their sources are in ``docs/simulator.md`` ("The
profile h100-llama3.1-8b"). ``l4-llama3.1-8b`` is the same model and
engine on one NVIDIA L4 24GB, a pool that saturates at a few requests per
second and whose KV cache holds about one copy of the open-loop workloads'
system prompts ("The profile l4-llama3.1-8b"). ``l4-llama2-7b`` is the seed
experiment's hardware: Llama-2-7B on one NVIDIA L4, ``--max-loras 4
--max-cpu-loras 12``. Prefill ``max(0.04, 0.02 + 0.0002 * tokens)``, the LoRA
load costs and the 700 KV blocks are the design's figures. The decode step
``T0 + k * batch`` was fitted: the design's first estimate (``T0 = 0.052 s``,
``k = 0.0022 s``) reproduces the published random-routing result but caps even
a perfect adapter partition below the published LoRA-affinity result, so
``T0 = 0.060 s``, ``k = 0.0008 s`` were fitted to both published results at
once (``docs/simulator.md``, "Calibration").
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any, Final, Literal


@dataclass(frozen=True, slots=True)
class Profile:
    """The fixed characteristics of one simulated model server (times in seconds)."""

    name: str
    base_model: str
    # Step timing.
    decode_base_s: float
    decode_per_sequence_s: float
    prefill_min_s: float
    prefill_base_s: float
    prefill_per_token_s: float
    # Scheduler limits (vLLM V0 defaults for this model unless noted).
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # KV cache.
    block_size: int
    num_gpu_blocks: int
    watermark: float
    enable_prefix_caching: bool
    # LoRA.
    max_loras: int
    max_cpu_loras: int
    lora_gpu_load_s: float
    lora_disk_load_s: float
    # Natural length of a generated text, uniform in [min, max] before max_tokens caps it.
    output_tokens_min: int
    output_tokens_max: int
    # vLLM V1 only (scheduler "v1"): one step of a mixed batch costs
    # step_base_s + per prefill token + per decode sequence + per context token
    # read (the KV of every scheduled sequence), see step_s.
    scheduler: Literal["v0", "v1"] = "v0"
    step_base_s: float = 0.0
    step_per_prefill_token_s: float = 0.0
    step_per_decode_sequence_s: float = 0.0
    step_per_context_token_s: float = 0.0
    # When set, a request with max_tokens m writes a natural length uniform in
    # [1, ceil(share * m)] (so its mean sits near share / 2 of the cap) instead
    # of the fixed [min, max] range, which then serves requests without one.
    output_share_of_max_tokens: float | None = None
    # Whether the HTTP front renders chat requests with the assistant's opening
    # line (the chat template's generation prompt), as vLLM does.
    chat_generation_prompt: bool = False
    # Reported in vllm:cache_config_info only.
    gpu_memory_utilization: float = 0.9
    num_cpu_blocks: int = 512
    swap_space_bytes: int = 4 << 30
    # vLLM's API server logs the engine's stats (and with them the
    # vllm:lora_requests_info series) every VLLM_LOG_STATS_INTERVAL seconds,
    # busy or idle, first that long after it starts; the engine also logs after
    # every step. In simulated seconds here.
    log_stats_interval_s: float = 10.0
    # Disaggregated prefill/decode (vLLM V1 only): the KV cache one token takes
    # (kv_bytes_per_token from the model config) and the link a decode pod
    # reads a prefill pod's blocks over: a fixed setup time per transfer, then
    # bytes at kv_transfer_bytes_per_s (kv_transfer_s). Sources in
    # docs/simulator.md ("Prefill and decode roles").
    kv_bytes_per_token: int = 0
    kv_transfer_bytes_per_s: float = 1.0
    kv_transfer_setup_s: float = 0.0

    def __post_init__(self) -> None:
        if self.scheduler == "v0" and self.max_num_batched_tokens < self.max_model_len:
            # vLLM V0 without chunked prefill refuses this configuration too: a
            # long prompt could never be scheduled.
            raise ValueError("max_num_batched_tokens must be at least max_model_len")
        if not 0 < self.output_tokens_min <= self.output_tokens_max:
            raise ValueError("output lengths need 0 < output_tokens_min <= output_tokens_max")
        if self.max_loras < 1 or self.max_cpu_loras < self.max_loras:
            raise ValueError("LoRA slots need 1 <= max_loras <= max_cpu_loras")
        if not self.log_stats_interval_s > 0:
            raise ValueError("the stats logging interval must be positive")
        if self.scheduler not in ("v0", "v1"):
            raise ValueError(f"unknown scheduler {self.scheduler!r} (v0 or v1)")
        share = self.output_share_of_max_tokens
        if share is not None and not share > 0:
            raise ValueError("the output share of max_tokens must be positive")
        if self.kv_bytes_per_token < 0 or not self.kv_transfer_bytes_per_s > 0:
            raise ValueError("KV transfers need kv_bytes_per_token >= 0 and a positive bandwidth")
        if not self.kv_transfer_setup_s >= 0:
            raise ValueError("the KV transfer setup time must be at least 0")

    def decode_step_s(self, batch: int) -> float:
        """Duration of one decode step advancing ``batch`` sequences by a token each."""
        return self.decode_base_s + self.decode_per_sequence_s * batch

    def prefill_step_s(self, computed_tokens: int) -> float:
        """Duration of one prefill step computing ``computed_tokens`` prompt tokens."""
        return max(
            self.prefill_min_s, self.prefill_base_s + self.prefill_per_token_s * computed_tokens
        )

    def step_s(self, prefill_tokens: int, decode_sequences: int, context_tokens: int) -> float:
        """Duration of one V1 step: a mixed batch of prefill chunks and decodes.

        ``context_tokens`` are the tokens already in the KV cache that the
        batch's attention reads, summed over its sequences.
        """
        return (
            self.step_base_s
            + self.step_per_prefill_token_s * prefill_tokens
            + self.step_per_decode_sequence_s * decode_sequences
            + self.step_per_context_token_s * context_tokens
        )

    def kv_transfer_s(self, tokens: int) -> float:
        """How long a decode pod waits for ``tokens`` tokens' KV from a prefill pod."""
        return (
            self.kv_transfer_setup_s
            + tokens * self.kv_bytes_per_token / self.kv_transfer_bytes_per_s
        )

    def natural_output_tokens(self, rng: random.Random, max_tokens: int | None) -> int:
        """How long the text a request would write is, before ``max_tokens`` caps it."""
        share = self.output_share_of_max_tokens
        if share is not None and max_tokens is not None:
            return rng.randint(1, max(1, math.ceil(share * max_tokens)))
        return rng.randint(self.output_tokens_min, self.output_tokens_max)

    def with_changes(self, **changes: Any) -> Profile:
        """A copy with some constants replaced (tests build small hand-made pods this way)."""
        return dataclasses.replace(self, **changes)


def model_kv_bytes(*, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """The KV cache of one token: a key and a value vector per KV head and layer."""
    return layers * kv_heads * head_dim * 2 * dtype_bytes


L4_LLAMA2_7B: Final = Profile(
    name="l4-llama2-7b",
    base_model="meta-llama/Llama-2-7b-hf",
    decode_base_s=0.060,
    decode_per_sequence_s=0.0008,
    prefill_min_s=0.04,
    prefill_base_s=0.02,
    prefill_per_token_s=0.0002,
    max_num_seqs=256,
    max_num_batched_tokens=4096,
    max_model_len=4096,
    block_size=16,
    num_gpu_blocks=700,
    watermark=0.01,
    enable_prefix_caching=True,
    max_loras=4,
    max_cpu_loras=12,
    lora_gpu_load_s=0.03,
    lora_disk_load_s=0.5,
    output_tokens_min=50,
    output_tokens_max=750,
    # Llama-2-7B: 32 layers, 32 KV heads (no GQA) of 128 dimensions, fp16.
    kv_bytes_per_token=model_kv_bytes(layers=32, kv_heads=32, head_dim=128),
    # Measured NixlConnector transfers without a GPU-to-GPU path (vLLM issue
    # 34054): 313 MB in 173.8 ms (1.8 GB/s) after 129 ms to post the transfer.
    kv_transfer_bytes_per_s=1.8e9,
    kv_transfer_setup_s=0.129,
)

H100_LLAMA31_8B: Final = Profile(
    name="h100-llama3.1-8b",
    base_model="meta-llama/Llama-3.1-8B-Instruct",
    scheduler="v1",
    step_base_s=0.0064,
    step_per_prefill_token_s=0.000027,
    step_per_decode_sequence_s=0.000027,
    step_per_context_token_s=0.000000053,
    # V0's step constants do not apply to a V1 pod.
    decode_base_s=0.0,
    decode_per_sequence_s=0.0,
    prefill_min_s=0.0,
    prefill_base_s=0.0,
    prefill_per_token_s=0.0,
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    max_model_len=131072,
    block_size=16,
    num_gpu_blocks=27500,
    watermark=0.0,
    enable_prefix_caching=True,
    max_loras=4,
    max_cpu_loras=12,
    lora_gpu_load_s=0.03,
    lora_disk_load_s=0.5,
    output_tokens_min=16,
    output_tokens_max=1024,
    output_share_of_max_tokens=1.2,
    chat_generation_prompt=True,
    # Llama-3.1-8B: 32 layers, 8 KV heads (GQA) of 128 dimensions, bf16.
    kv_bytes_per_token=model_kv_bytes(layers=32, kv_heads=8, head_dim=128),
    # Measured NixlConnector transfers between GPU pods over RDMA (vLLM issue
    # 50913, 3P1D): 167 MB in 38.7 ms (4.3 GB/s) after 6.7 ms to post it.
    kv_transfer_bytes_per_s=4.3e9,
    kv_transfer_setup_s=0.0067,
)

L4_LLAMA31_8B: Final = H100_LLAMA31_8B.with_changes(
    name="l4-llama3.1-8b",
    step_base_s=0.071,
    step_per_prefill_token_s=0.000221,
    step_per_decode_sequence_s=0.000221,
    step_per_context_token_s=0.000000583,
    max_num_seqs=256,
    max_num_batched_tokens=2048,
    max_model_len=32768,
    num_gpu_blocks=2300,
    # L4 nodes have no GPUDirect RDMA NIC: the transfer of vLLM issue 34054
    # without a GPU-to-GPU path (l4-llama2-7b's figures).
    kv_transfer_bytes_per_s=1.8e9,
    kv_transfer_setup_s=0.129,
)

PROFILES: Final[dict[str, Profile]] = {
    p.name: p for p in (L4_LLAMA2_7B, H100_LLAMA31_8B, L4_LLAMA31_8B)
}


def get_profile(name: str) -> Profile:
    """The named profile, or a ``KeyError`` that lists the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise KeyError(f"unknown simulator profile {name!r} (known: {known})") from None
