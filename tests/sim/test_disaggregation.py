"""An open-loop run whose router splits requests between a prefill pod and a decode pod.

A ``Split`` route has the prefill pod compute the prompt (``remote_decode``), then
hands the decode pod the decode half (``remote_prefill``), which waits the
engine's ``Profile.kv_transfer_s`` for the blocks it does not hold
(``test_pd_engine.py`` checks the engine's side).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from test_v1_rules import prompt

from policyd.sim.experiment import PodView
from policyd.sim.open_loop import (
    Arrival,
    OpenRequest,
    OpenRoutingFunction,
    Split,
    Turn,
    run_open_loop,
)
from policyd.sim.profile import H100_LLAMA31_8B, L4_LLAMA31_8B

V1 = H100_LLAMA31_8B


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
    assert split.first_token is not None and aggregated.first_token is not None
    # The prompt's compute is the same, on the other pod; the pull and one more step cost.
    assert split.first_token > aggregated.first_token + profile.kv_transfer_s(2999)
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
    assert not record.completed and record.first_token is None
    assert done == [0]
