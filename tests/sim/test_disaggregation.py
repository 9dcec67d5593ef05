"""Disaggregated prefill/decode in the simulator: the decode half of a split request, and
an open-loop run whose router splits.

A remotely prefilled request (``SimRequest.prefilled_remotely``) arrives with its
prompt's KV already moved to the decode pod, so the decode pod computes only the
last prompt token; an open-loop ``Split`` route has the prefill pod compute the
prompt first, then waits ``Profile.kv_transfer_s`` for the blocks the decode pod
does not hold.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from test_v1_rules import Recorder, prompt, simulate

from policyd.sim.blocks import BlocksStored
from policyd.sim.engine import SimRequest
from policyd.sim.experiment import PodView
from policyd.sim.open_loop import (
    Arrival,
    OpenRequest,
    OpenRoutingFunction,
    Split,
    Turn,
    run_open_loop,
)
from policyd.sim.profile import H100_LLAMA31_8B, L4_LLAMA2_7B, L4_LLAMA31_8B
from policyd.sim.virtual import VirtualLoop, VirtualPod

V1 = H100_LLAMA31_8B


def test_a_remotely_prefilled_request_computes_only_its_last_prompt_token() -> None:
    recorder = Recorder()
    long = prompt(4000)
    local = SimRequest("local", long, 2, output_length=2, listener=recorder)
    remote = SimRequest(
        "remote", prompt(4000, 20_000), 2, output_length=2, listener=recorder,
        prefilled_remotely=True,
    )  # fmt: skip
    _, local_states = simulate(V1, [(0.0, local)])
    loop = VirtualLoop()
    pod = VirtualPod(loop, V1, name="decode")
    pod.engine.record_kv_events()
    remote_states = {"remote": pod.submit(remote)}
    loop.run()
    local_first = local_states["local"].first_token_at
    remote_first = remote_states["remote"].first_token_at
    assert local_first is not None and remote_first is not None
    one_token_step = V1.step_s(1, 0, 3999)
    assert remote_first == pytest.approx(one_token_step)
    assert local_first > 3 * remote_first  # 4,000 tokens in 8,192-token chunks
    # The pulled blocks are the pod's now: cached and announced, but not counted as hits.
    stored = [e for e in pod.engine.take_kv_events() if isinstance(e, BlocksStored)]
    assert sum(len(e.block_hashes) for e in stored) >= 3999 // V1.block_size
    assert remote_states["remote"].cached_tokens == 0
    assert pod.engine.stats.prefix_cache_hits == 0


def test_the_v0_engine_refuses_a_remotely_prefilled_request() -> None:
    pod = VirtualPod(VirtualLoop(), L4_LLAMA2_7B, name="v0")
    with pytest.raises(ValueError, match="V1"):
        pod.submit(SimRequest("r", prompt(100), 4, prefilled_remotely=True))


def test_the_transfer_takes_the_kv_bytes_over_the_link() -> None:
    profile = L4_LLAMA31_8B
    bytes_ = 3000 * profile.kv_bytes_per_token
    expected = profile.kv_transfer_setup_s + bytes_ / profile.kv_transfer_bytes_per_s
    assert profile.kv_transfer_s(3000) == pytest.approx(expected)
    assert profile.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B, 16-bit KV


def requests(prompts: Sequence[int], *, every_s: float = 1.0) -> list[OpenRequest]:
    return [
        OpenRequest(i * every_s, None, (Turn(None, ("x",)),), prompt(n, 1000 * (i + 1)), 8, 8)
        for i, n in enumerate(prompts)
    ]


def split_to(decode: int, prefill: int | None) -> OpenRoutingFunction:
    def route(arrival: Arrival, pods: Sequence[PodView], rng: random.Random) -> int | Split:
        return decode if prefill is None else Split(decode, prefill)

    return route


def test_a_split_request_is_prefilled_then_pulled_then_decoded() -> None:
    profile = L4_LLAMA31_8B
    (aggregated,) = run_open_loop(
        split_to(0, None), requests([3000]), pods=2, profile=profile
    ).records
    result = run_open_loop(split_to(0, 1), requests([3000]), pods=2, profile=profile)
    (split,) = result.records
    assert split.completed and split.pod == 0 and split.prefill_pod == 1
    assert split.transfer_s == pytest.approx(profile.kv_transfer_s(2999))
    assert split.first_token is not None and aggregated.first_token is not None
    # The prompt's compute is the same, on the other pod; the pull and one more step cost.
    assert split.first_token > aggregated.first_token + split.transfer_s
    assert split.output_tokens == aggregated.output_tokens == 8
    assert len(result.token_gaps_s) == 7
    assert result.split_share == 1.0


def test_a_split_keeps_a_long_prompt_from_stalling_the_decode_pods_answers() -> None:
    """One long answer decodes on pod 0 while long prompts arrive; routed to pod 0 whole,
    their prefill chunks share its steps and stretch its token gaps; split, pod 1 computes
    them and pod 0 only decodes."""
    profile = L4_LLAMA31_8B
    streaming = OpenRequest(0.0, None, (Turn(None, ("x",)),), prompt(50), 300, 300)
    long_prompts = [
        OpenRequest(2.0 + i, None, (Turn(None, ("x",)),), prompt(6000, 10_000 * (i + 1)), 4, 4)
        for i in range(4)
    ]

    def worst_gap(route_long: int | Split) -> float:
        def route(arrival: Arrival, pods: Sequence[PodView], rng: random.Random) -> int | Split:
            return 0 if arrival.index == 0 else route_long

        result = run_open_loop(route, [streaming, *long_prompts], pods=2, profile=profile)
        assert result.completed == 5
        return max(result.token_gaps_s)

    aggregated, split = worst_gap(0), worst_gap(Split(0, 1))
    assert split < aggregated / 3
    assert split < 2 * profile.step_s(0, 2, 6000)


def test_a_client_that_gives_up_during_the_prefill_frees_both_pods() -> None:
    done: list[int] = []
    result = run_open_loop(
        split_to(0, 1), requests([6000]), pods=2, profile=L4_LLAMA31_8B, timeout_s=0.5,
        on_done=done.append,
    )  # fmt: skip
    (record,) = result.records
    assert not record.completed and record.transfer_s is None
    assert done == [0]
