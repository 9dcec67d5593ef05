"""Calibration profiles: lookup by name and the configurations vLLM itself would refuse."""

from __future__ import annotations

import pytest

from policyd.sim.engine_v1 import EngineV1, new_engine
from policyd.sim.profile import (
    H100_LLAMA31_8B,
    L4_LLAMA2_7B,
    L4_LLAMA31_8B,
    PROFILES,
    Profile,
    get_profile,
)
from policyd.sim.workloads import SharedPrefix


def test_profiles_are_found_by_name_and_unknown_names_list_the_known_ones() -> None:
    assert get_profile("l4-llama2-7b") is L4_LLAMA2_7B
    assert get_profile("h100-llama3.1-8b") is H100_LLAMA31_8B
    assert get_profile("l4-llama3.1-8b") is L4_LLAMA31_8B
    with pytest.raises(
        KeyError, match=r"known: h100-llama3\.1-8b, l4-llama2-7b, l4-llama3\.1-8b\)"
    ):
        get_profile("h100-llama3-70b")


def test_a_v1_profile_may_budget_fewer_tokens_per_step_than_its_context() -> None:
    # Chunked prefill splits a long prompt over steps, so vLLM V1 accepts this.
    assert H100_LLAMA31_8B.max_num_batched_tokens < H100_LLAMA31_8B.max_model_len
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        H100_LLAMA31_8B.with_changes(scheduler="v0")


def test_the_v1_step_cost_grows_with_every_term() -> None:
    profile = H100_LLAMA31_8B
    base = profile.step_s(0, 1, 1000)
    assert profile.step_s(512, 1, 1000) > base  # prefill tokens
    assert profile.step_s(0, 2, 1000) > base  # decode sequences
    assert profile.step_s(0, 1, 100_000) > base  # context read


def test_the_seed_profile_carries_the_calibration_constants() -> None:
    profile = L4_LLAMA2_7B
    assert profile.decode_step_s(10) == pytest.approx(0.060 + 0.0008 * 10)
    assert profile.prefill_step_s(17) == pytest.approx(0.04)
    assert profile.prefill_step_s(1000) == pytest.approx(0.22)
    assert (profile.max_loras, profile.max_cpu_loras, profile.num_gpu_blocks) == (4, 12, 700)


@pytest.mark.parametrize("profile", PROFILES.values(), ids=list(PROFILES))
def test_every_shipped_profile_caches_a_request_of_its_full_length(profile: Profile) -> None:
    # vLLM refuses to start otherwise (tests build smaller caches by hand).
    assert profile.num_gpu_blocks * profile.block_size >= profile.max_model_len


def test_the_l4_v1_profile_runs_v1_and_its_cache_cannot_hold_every_shared_prefix_twice() -> None:
    # What the profile is for: on an H100 every pod caches every group's system
    # prompt many times over, so prefix routing shows nothing there.
    assert isinstance(new_engine(L4_LLAMA31_8B), EngineV1)
    workload = SharedPrefix()
    prompts = workload.groups * workload.system_tokens // L4_LLAMA31_8B.block_size
    assert L4_LLAMA31_8B.num_gpu_blocks < 2 * prompts < H100_LLAMA31_8B.num_gpu_blocks // 5
    # The same batch costs the L4 more than the H100 in every term.
    for batch in ((512, 0, 0), (0, 8, 0), (0, 0, 10_000)):
        assert L4_LLAMA31_8B.step_s(*batch) > H100_LLAMA31_8B.step_s(*batch)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"max_num_batched_tokens": 2048}, "max_num_batched_tokens"),
        ({"output_tokens_min": 0}, "output lengths"),
        ({"max_loras": 8, "max_cpu_loras": 4}, "max_loras <= max_cpu_loras"),
    ],
)
def test_configurations_vllm_would_refuse_are_refused(
    changes: dict[str, int], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        L4_LLAMA2_7B.with_changes(**changes)
