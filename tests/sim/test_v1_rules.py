"""vLLM V1's scheduler rules (``engine_v1``) in virtual time, each checked against V0 where
the two differ, so every test fails on the V0 engine's behaviour.

The pods are ``h100-llama3.1-8b`` with a few limits made small (token budget,
KV blocks) so that a handful of requests shows each rule.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence

import pytest

from policyd.sim.blocks import BlocksStored
from policyd.sim.engine import RequestState, SimRequest
from policyd.sim.engine_v1 import EngineV1
from policyd.sim.profile import H100_LLAMA31_8B, L4_LLAMA2_7B, Profile
from policyd.sim.text import token_id
from policyd.sim.virtual import VirtualLoop, VirtualPod

V1 = H100_LLAMA31_8B
BLOCK = V1.block_size


class Recorder:
    """Remembers when every token of every request came out."""

    def __init__(self) -> None:
        self.token_times: dict[str, list[float]] = defaultdict(list)

    def on_progress(self, state: RequestState, now: float) -> None:
        times = self.token_times[state.request.request_id]
        times.extend([now] * (state.generated - len(times)))


def prompt(length: int, start: int = 100) -> tuple[int, ...]:
    return tuple(range(start, start + length))


def simulate(
    profile: Profile, arrivals: Sequence[tuple[float, SimRequest]]
) -> tuple[VirtualPod, dict[str, RequestState]]:
    """Submit each request at its time and run until the pod is idle."""
    loop = VirtualLoop()
    pod = VirtualPod(loop, profile, name="test")
    states: dict[str, RequestState] = {}

    def arrive(sim_request: SimRequest) -> None:
        states[sim_request.request_id] = pod.submit(sim_request)

    for at, sim_request in arrivals:
        loop.call_at(at, lambda r=sim_request: arrive(r))
    loop.run()
    return pod, states


def test_a_v1_profile_gets_the_v1_engine() -> None:
    assert isinstance(VirtualPod(VirtualLoop(), V1, name="p").engine, EngineV1)
    assert not isinstance(VirtualPod(VirtualLoop(), L4_LLAMA2_7B, name="p").engine, EngineV1)


# -- chunked prefill ----------------------------------------------------------------------------


def long_prefill_during_a_decode(profile: Profile) -> tuple[list[float], float, float]:
    """``a`` decodes while a 4,000-token prompt ``b`` arrives: a's token times, b's arrival
    and b's first token."""
    recorder = Recorder()
    arrivals = [
        (0.0, SimRequest("a", prompt(20), 400, output_length=400, listener=recorder)),
        (0.5, SimRequest("b", prompt(4000, 9000), 10, output_length=10, listener=recorder)),
    ]
    _, states = simulate(profile, arrivals)
    first = states["b"].first_token_at
    assert first is not None
    return recorder.token_times["a"], 0.5, first


def test_a_long_prefill_is_chunked_and_the_running_decode_gets_a_token_every_step() -> None:
    profile = V1.with_changes(max_num_batched_tokens=512)
    a_times, arrived, b_first = long_prefill_during_a_decode(profile)
    during = [t for t in a_times if arrived < t <= b_first]
    # 4,000 prompt tokens in chunks of at most 511 (a's decode takes one of the 512):
    # at least 8 steps, each of which also advances a by one token.
    assert len(during) >= 8
    gaps = [later - earlier for earlier, later in itertools.pairwise(a_times)]
    longest_chunk_step = profile.step_s(511, 1, 4000 + 420)
    assert max(gaps) <= longest_chunk_step


def test_v0_stalls_the_running_decode_for_the_whole_prefill() -> None:
    # The same arrivals on V0 rules: b's prefill runs alone, a gets no token meanwhile.
    profile = L4_LLAMA2_7B.with_changes(max_num_batched_tokens=4096)
    a_times, arrived, b_first = long_prefill_during_a_decode(profile)
    # only the step already running when b arrived ends in between
    assert len([t for t in a_times if arrived < t < b_first]) <= 1
    gaps = [later - earlier for earlier, later in itertools.pairwise(a_times)]
    assert max(gaps) >= profile.prefill_step_s(4000)


# -- decode cost ----------------------------------------------------------------------------------


def decode_gap(context: int) -> float:
    """The time between two decode tokens of a lone request with a ``context``-token prompt."""
    recorder = Recorder()
    simulate(V1, [(0.0, SimRequest("a", prompt(context), 3, output_length=3, listener=recorder))])
    times = recorder.token_times["a"]
    return times[2] - times[1]


def test_a_decode_step_costs_more_the_more_context_it_reads() -> None:
    short, long = decode_gap(100), decode_gap(60_000)
    assert long > short
    # exactly the profile's cost of one decode reading the cached context
    assert short == pytest.approx(V1.step_s(0, 1, 101), abs=1e-12)
    assert long == pytest.approx(V1.step_s(0, 1, 60_001), abs=1e-12)


# -- prefix caching of generated tokens ----------------------------------------------------------


def resend_after_reply(profile: Profile) -> tuple[RequestState, int]:
    """A 100-token prompt answered with 64 tokens, then a follow-up resending prompt, reply and
    a new question: the follow-up's state and how many tokens it shares with the first turn."""
    first_prompt = prompt(100)
    reply = tuple(token_id(7, i) for i in range(64))
    follow_up = first_prompt + reply + prompt(40, 5000)
    arrivals = [
        (0.0, SimRequest("turn-1", first_prompt, 64, output_length=64, text_seed=7)),
        (10.0, SimRequest("turn-2", follow_up, 8, output_length=8)),
    ]
    _, states = simulate(profile, arrivals)
    assert states["turn-1"].finished and states["turn-2"].finished
    return states["turn-2"], len(first_prompt) + len(reply)


def test_generated_blocks_are_cached_and_hit_by_a_follow_up_resending_the_conversation() -> None:
    state, shared = resend_after_reply(V1)
    # Every full block the first turn computed: its prompt and 63 of its 64 tokens
    # (the last generated token is never fed back), 163 tokens -> 10 blocks.
    assert state.cached_tokens == (shared - 1) // BLOCK * BLOCK == 160
    assert state.cached_tokens > len(prompt(100))


def test_v0_caches_prompt_blocks_only() -> None:
    state, _ = resend_after_reply(L4_LLAMA2_7B)
    assert state.cached_tokens == 100 // BLOCK * BLOCK


def test_generated_blocks_are_announced_with_their_token_ids() -> None:
    loop = VirtualLoop()
    pod = VirtualPod(loop, V1, name="events")
    pod.engine.record_kv_events()
    pod.submit(SimRequest("a", prompt(16), 40, output_length=40, text_seed=3))
    loop.run()
    stored = [e for e in pod.engine.take_kv_events() if isinstance(e, BlocksStored)]
    token_ids = [t for event in stored for t in event.token_ids]
    reply = [token_id(3, i) for i in range(32)]
    assert token_ids == [*prompt(16), *reply]  # 3 full blocks: the prompt's and two of the reply


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    _, states = simulate(
        V1,
        [
            (0.0, SimRequest("a", prompt(64), 1, output_length=1)),
            (1.0, SimRequest("b", prompt(64), 1, output_length=1)),
        ],
    )
    # vLLM V1 stops the look-up one token short, so the last full block is recomputed.
    assert states["b"].cached_tokens == 48


# -- preemption -----------------------------------------------------------------------------------


def test_the_newest_running_request_is_preempted_and_recomputed_from_its_cached_blocks() -> None:
    profile = V1.with_changes(num_gpu_blocks=12)
    recorder = Recorder()
    arrivals = [
        (0.0, SimRequest("old", prompt(40), 60, output_length=60, listener=recorder)),
        (0.001, SimRequest("new", prompt(40, 3000), 60, output_length=60, listener=recorder)),
    ]
    pod, states = simulate(profile, arrivals)
    assert pod.engine.stats.preemptions >= 1
    assert states["old"].finished and states["new"].finished
    # the older request ran through; the newer one was pushed out and came back
    assert states["old"].finished_at is not None and states["new"].finished_at is not None
    assert states["old"].finished_at < states["new"].finished_at
    # the older request got a token in every step; each readmission of the newer one
    # found the full blocks it had computed still cached
    old_times = recorder.token_times["old"]
    gaps = [later - earlier for earlier, later in itertools.pairwise(old_times)]
    assert max(gaps) <= profile.step_s(BLOCK * 12, 2, BLOCK * 12)
    assert states["new"].cached_tokens > 0


# -- output lengths ------------------------------------------------------------------------------


def test_drawn_output_lengths_stay_well_below_max_tokens_and_some_stop_early() -> None:
    arrivals = [(0.01 * i, SimRequest(f"r{i}", prompt(30, 100 + i), 200)) for i in range(200)]
    _, states = simulate(V1, arrivals)
    lengths = [s.generated for s in states.values()]
    assert all(s.finished for s in states.values())
    assert max(lengths) <= 200
    assert sum(lengths) / len(lengths) < 0.75 * 200
    reasons = {s.finish_reason for s in states.values()}
    assert reasons == {"stop", "length"}


def test_requests_without_max_tokens_draw_from_the_profile_range_and_complete() -> None:
    arrivals = [(0.01 * i, SimRequest(f"r{i}", prompt(30, 100 + i), None)) for i in range(50)]
    _, states = simulate(V1, arrivals)
    lengths = [s.generated for s in states.values()]
    assert all(s.finished and s.finish_reason == "stop" for s in states.values())
    assert V1.output_tokens_min <= min(lengths) and max(lengths) <= V1.output_tokens_max
    assert len(set(lengths)) > 10  # drawn, not fixed


def test_without_max_tokens_the_context_left_caps_the_length() -> None:
    profile = V1.with_changes(max_model_len=100)
    _, states = simulate(profile, [(0.0, SimRequest("a", prompt(90), None, output_length=500))])
    assert states["a"].generated == 10 and states["a"].finish_reason == "length"


# -- LoRA -----------------------------------------------------------------------------------------


def test_a_batch_holds_at_most_max_loras_adapters() -> None:
    profile = V1.with_changes(max_loras=1, max_cpu_loras=2)
    arrivals = [
        (0.0, SimRequest("x", prompt(20), 30, adapter="adapter-0", output_length=30)),
        (0.0, SimRequest("y", prompt(20), 30, adapter="adapter-1", output_length=30)),
        (0.0, SimRequest("z", prompt(20), 30, adapter="adapter-0", output_length=30)),
    ]
    _, states = simulate(profile, arrivals)
    # z passes y (its adapter is in the batch); y starts once adapter-0 is gone
    y_first, z_first = states["y"].first_token_at, states["z"].first_token_at
    assert y_first is not None and z_first is not None
    assert z_first < y_first
    assert all(
        s.finished_at is not None and s.finished_at <= y_first for s in (states["x"], states["z"])
    )
