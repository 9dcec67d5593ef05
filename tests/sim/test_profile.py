"""Calibration profiles: lookup by name and the configurations vLLM itself would refuse."""

from __future__ import annotations

import pytest

from policyd.sim.profile import L4_LLAMA2_7B, get_profile


def test_profiles_are_found_by_name_and_unknown_names_list_the_known_ones() -> None:
    assert get_profile("l4-llama2-7b") is L4_LLAMA2_7B
    with pytest.raises(KeyError, match="known: l4-llama2-7b"):
        get_profile("h100-llama3-70b")


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
