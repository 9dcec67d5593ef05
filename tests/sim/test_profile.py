"""Calibration profiles: lookup by name and the configurations vLLM itself would refuse."""

from __future__ import annotations

import pytest

from policyd.sim.profile import H100_LLAMA31_8B, L4_LLAMA2_7B, get_profile


def test_profiles_are_found_by_name_and_unknown_names_list_the_known_ones() -> None:
    assert get_profile("l4-llama2-7b") is L4_LLAMA2_7B
    assert get_profile("h100-llama3.1-8b") is H100_LLAMA31_8B
    with pytest.raises(KeyError, match=r"known: h100-llama3\.1-8b, l4-llama2-7b"):
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
