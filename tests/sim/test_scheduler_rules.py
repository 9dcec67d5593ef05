"""The V0 scheduler rules on small hand-made cases, with exact expected timings.

The pods below use round timing constants of their own (the design's first
estimate, independent of the calibrated profile): a decode step of a batch of
``b`` takes ``0.052 + 0.0022 * b`` s; a prefill step takes
``max(0.04, 0.02 + 0.0002 * computed_tokens)`` s; an adapter costs 0.5 s from
disk and 0.03 s from host memory when it is not in a GPU slot.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import pytest

from policyd.sim.engine import Engine, Phase, RequestState, SimRequest
from policyd.sim.profile import L4_LLAMA2_7B, Profile
from policyd.sim.virtual import VirtualLoop, VirtualPod

PROMPT_17 = tuple(range(100, 117))
POD = L4_LLAMA2_7B.with_changes(decode_base_s=0.052, decode_per_sequence_s=0.0022)


class Recorder:
    """Remembers when every token of every request came out."""

    def __init__(self) -> None:
        self.token_times: dict[str, list[float]] = defaultdict(list)

    def on_progress(self, state: RequestState, now: float) -> None:
        times = self.token_times[state.request.request_id]
        times.extend([now] * (state.generated - len(times)))


def request(
    request_id: str,
    length: int,
    *,
    adapter: str | None = None,
    prompt: tuple[int, ...] = PROMPT_17,
    max_tokens: int = 750,
    recorder: Recorder | None = None,
) -> SimRequest:
    return SimRequest(
        request_id,
        prompt,
        max_tokens,
        adapter=adapter,
        output_length=length,
        listener=recorder,
    )


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


def exactly(value: float) -> object:
    return pytest.approx(value, abs=1e-9)


# -- batching -----------------------------------------------------------------------------------


def test_one_request_is_one_prefill_then_one_decode_step_per_token() -> None:
    recorder = Recorder()
    _, states = simulate(POD, [(0.0, request("a", 3, recorder=recorder))])
    # prefill 17 tokens: max(0.04, 0.0234) = 0.04; decode batch 1: 0.0542
    assert recorder.token_times["a"] == [exactly(0.04), exactly(0.0942), exactly(0.1484)]
    state = states["a"]
    assert state.finished and state.finish_reason == "stop"
    assert state.first_token_at == exactly(0.04)
    assert state.finished_at == exactly(0.1484)


def test_decode_step_time_grows_with_the_batch() -> None:
    recorder = Recorder()
    arrivals = [(0.0, request(name, 3, recorder=recorder)) for name in "abc"]
    simulate(POD, arrivals)
    # one prefill for all three (51 tokens: 0.0302 -> 0.04), then batch-3 decodes of 0.0586
    for name in "abc":
        assert recorder.token_times[name] == [exactly(0.04), exactly(0.0986), exactly(0.1572)]


def test_prefill_time_grows_with_prompt_tokens() -> None:
    recorder = Recorder()
    simulate(POD, [(0.0, request("a", 1, prompt=tuple(range(500)), recorder=recorder))])
    assert recorder.token_times["a"] == [exactly(0.02 + 0.0002 * 500)]


def test_a_new_arrival_is_prefilled_alone_at_the_next_step_boundary() -> None:
    recorder = Recorder()
    arrivals = [
        (0.0, request("a", 4, recorder=recorder)),
        (0.05, request("b", 2, recorder=recorder)),  # during a's first decode [0.04, 0.0942]
    ]
    simulate(POD, arrivals)
    # a: prefill 0.04, decode 0.0942; b's prefill runs alone 0.0942 -> 0.1342;
    # then one batch-2 decode (0.0564) finishes b, and a decodes alone (0.0542)
    assert recorder.token_times["a"] == [
        exactly(0.04),
        exactly(0.0942),
        exactly(0.1906),
        exactly(0.2448),
    ]
    assert recorder.token_times["b"] == [exactly(0.1342), exactly(0.1906)]


def test_max_num_seqs_caps_the_running_batch() -> None:
    profile = POD.with_changes(max_num_seqs=2)
    recorder = Recorder()
    arrivals = [(0.0, request(name, 2, recorder=recorder)) for name in "abc"]
    simulate(profile, arrivals)
    assert recorder.token_times["a"] == [exactly(0.04), exactly(0.0964)]
    assert recorder.token_times["b"] == [exactly(0.04), exactly(0.0964)]
    # c waits for a slot: prefill at 0.0964, then one decode of batch 1
    assert recorder.token_times["c"] == [exactly(0.1364), exactly(0.1906)]


# -- LoRA adapters ------------------------------------------------------------------------------


def test_a_request_whose_adapter_cannot_run_is_skipped_and_later_ones_pass_it() -> None:
    profile = POD.with_changes(max_loras=2)
    recorder = Recorder()
    arrivals = [
        (0.0, request("a1", 2, adapter="a", recorder=recorder)),
        (0.0, request("b1", 4, adapter="b", recorder=recorder)),
        (0.0, request("c1", 2, adapter="c", recorder=recorder)),
        (0.0, request("a2", 2, adapter="a", recorder=recorder)),
    ]
    loop = VirtualLoop()
    pod = VirtualPod(loop, profile, name="test")
    for _, sim_request in arrivals:
        pod.submit(sim_request)
    loop.run(until=1.04)
    # one prefill admits a1, b1 and a2 (c1 skipped), loading a and b from disk: 0.04 + 2 * 0.5
    snapshot = pod.snapshot()
    assert snapshot.at == exactly(1.04)
    assert (snapshot.running, snapshot.waiting) == (3, 1)
    assert snapshot.running_adapters == ("a", "b")
    assert snapshot.waiting_adapters == ("c",)
    loop.run()
    assert recorder.token_times["a1"] == [exactly(1.04), exactly(1.0986)]
    assert recorder.token_times["a2"] == [exactly(1.04), exactly(1.0986)]
    # every request of adapter a finished at 1.0986: c1 starts, loading c from disk
    assert recorder.token_times["c1"] == [exactly(1.0986 + 0.54), exactly(1.6386 + 0.0564)]
    assert recorder.token_times["b1"] == [
        exactly(1.04),
        exactly(1.0986),
        exactly(1.6950),
        exactly(1.7492),
    ]


def test_a_new_adapter_waits_until_every_running_request_of_some_adapter_finished() -> None:
    profile = POD.with_changes(max_loras=2)
    recorder = Recorder()
    arrivals = [
        (0.0, request("a1", 2, adapter="a", recorder=recorder)),
        (0.0, request("b1", 4, adapter="b", recorder=recorder)),
        (0.0, request("c1", 1, adapter="c", recorder=recorder)),
        (0.0, request("a2", 4, adapter="a", recorder=recorder)),
    ]
    simulate(profile, arrivals)
    # a1 finishes at 1.0986 but a2 still runs adapter a: c1 keeps waiting until
    # a2 and b1 finish together after two more batch-2 decodes (1.1550, 1.2114)
    assert recorder.token_times["a2"][-1] == exactly(1.2114)
    assert recorder.token_times["b1"][-1] == exactly(1.2114)
    assert recorder.token_times["c1"] == [exactly(1.2114 + 0.54)]


def test_adapter_load_cost_depends_on_gpu_slots_and_host_memory() -> None:
    profile = POD.with_changes(max_loras=1, max_cpu_loras=2)
    recorder = Recorder()
    plan = [(0.0, "a"), (1.0, "b"), (2.0, "a"), (3.0, "a"), (4.0, "c"), (5.0, "b")]
    arrivals = [
        (at, request(f"r{i}", 1, adapter=adapter, recorder=recorder))
        for i, (at, adapter) in enumerate(plan)
    ]
    simulate(profile, arrivals)
    finished = [recorder.token_times[f"r{i}"][0] - at for i, (at, _) in enumerate(plan)]
    assert finished == [
        exactly(0.54),  # a from disk
        exactly(0.54),  # b from disk (a leaves the only GPU slot, stays in host memory)
        exactly(0.07),  # a from host memory
        exactly(0.04),  # a already in the GPU slot
        exactly(0.54),  # c from disk; host memory keeps a and c, b is dropped
        exactly(0.54),  # b from disk again
    ]


def test_requests_for_the_base_model_do_not_count_against_max_loras() -> None:
    profile = POD.with_changes(max_loras=1)
    recorder = Recorder()
    arrivals = [
        (0.0, request("a", 1, adapter="a", recorder=recorder)),
        (0.0, request("base", 1, recorder=recorder)),
        (0.0, request("b", 1, adapter="b", recorder=recorder)),
    ]
    simulate(profile, arrivals)
    assert recorder.token_times["a"] == [exactly(0.54)]
    assert recorder.token_times["base"] == [exactly(0.54)]
    assert recorder.token_times["b"] == [exactly(1.08)]


# -- KV cache and preemption --------------------------------------------------------------------


def test_the_newest_running_sequence_is_preempted_and_recomputed_when_blocks_run_out() -> None:
    profile = POD.with_changes(num_gpu_blocks=10, watermark=0.0)
    recorder = Recorder()
    older = request("older", 100, prompt=tuple(range(16)), max_tokens=100, recorder=recorder)
    newer = request("newer", 70, prompt=tuple(range(16, 32)), max_tokens=100, recorder=recorder)
    pod, states = simulate(profile, [(0.0, older), (0.0, newer)])
    # Each holds ceil((16 + generated) / 16) blocks: 5 + 5 = 10 while generated <= 64.
    # Before the 65th decode both need a 6th block: the newer one is preempted.
    preempted_at = 0.04 + 64 * 0.0564
    newer_times = recorder.token_times["newer"]
    assert newer_times[64] == exactly(preempted_at)
    # The older one runs alone to its 100th token ...
    older_done = preempted_at + 35 * 0.0542
    assert recorder.token_times["older"][-1] == exactly(older_done)
    # ... then the newer one is readmitted: prompt + 65 generated tokens, its
    # prompt block still cached, so 65 tokens are recomputed (0.04 s).
    assert newer_times[65] == exactly(older_done + 0.04)
    assert newer_times[-1] == exactly(older_done + 0.04 + 4 * 0.0542)
    assert states["newer"].first_token_at == exactly(0.04)
    assert pod.engine.stats.preemptions == 1
    assert pod.engine.stats.prefix_cache_hits == 16


def test_admission_keeps_the_watermark_of_free_blocks() -> None:
    # 100 blocks, watermark 1 block; a 1600-token prompt needs exactly 100 blocks
    profile = POD.with_changes(num_gpu_blocks=101, watermark=0.01)
    engine = Engine(profile)
    engine.add(SimRequest("big", tuple(range(1584)), 16, output_length=1), 0.0)
    assert engine.start_step(0.0) is not None
    profile = POD.with_changes(num_gpu_blocks=101, watermark=0.02)
    engine = Engine(profile)
    with pytest.raises(ValueError, match="KV cache"):
        engine.add(SimRequest("big", tuple(range(1584)), 16, output_length=1), 0.0)


# -- prefix caching -----------------------------------------------------------------------------


def test_cached_prompt_blocks_skip_prefill() -> None:
    recorder = Recorder()
    long_prompt = tuple(range(1000))  # 62 full blocks (992 tokens) + 8
    other_prompt = (7, *long_prompt[1:])  # differs in the first block: no hit at all
    arrivals = [
        (0.0, request("first", 1, prompt=long_prompt, recorder=recorder)),
        (1.0, request("again", 1, prompt=long_prompt, recorder=recorder)),
        (2.0, request("other", 1, prompt=other_prompt, recorder=recorder)),
    ]
    pod, _ = simulate(POD, arrivals)
    assert recorder.token_times["first"] == [exactly(0.22)]  # 0.02 + 0.0002 * 1000
    assert recorder.token_times["again"] == [exactly(1.04)]  # 8 tokens computed
    assert recorder.token_times["other"] == [exactly(2.22)]
    stats = pod.engine.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (3000, 992)


def test_the_prefix_cache_is_per_adapter() -> None:
    profile = POD.with_changes(lora_disk_load_s=0.0, lora_gpu_load_s=0.0)
    recorder = Recorder()
    prompt = tuple(range(1000))
    arrivals = [
        (0.0, request("x1", 1, adapter="x", prompt=prompt, recorder=recorder)),
        (1.0, request("y1", 1, adapter="y", prompt=prompt, recorder=recorder)),
        (2.0, request("x2", 1, adapter="x", prompt=prompt, recorder=recorder)),
    ]
    simulate(profile, arrivals)
    assert recorder.token_times["x1"] == [exactly(0.22)]
    assert recorder.token_times["y1"] == [exactly(1.22)]
    assert recorder.token_times["x2"] == [exactly(2.04)]


def test_a_fully_cached_prompt_still_computes_one_token() -> None:
    engine = Engine(POD)
    prompt = tuple(range(32))  # exactly two full blocks
    for name in ("first", "second"):
        engine.add(SimRequest(name, prompt, 8, output_length=1), 0.0)
        engine.start_step(0.0)
        engine.finish_step(0.04)
    assert engine.stats.prefix_cache_hits == 31


def test_cached_blocks_are_evicted_least_recently_used_under_pressure() -> None:
    # 60 blocks, no watermark; each prompt is 320 tokens = 20 full blocks, one output
    # token, so each finished request leaves 20 cached blocks behind.
    profile = POD.with_changes(num_gpu_blocks=60, watermark=0.0)
    recorder = Recorder()
    prompts = {name: tuple(range(i * 1000, i * 1000 + 320)) for i, name in enumerate("pqrs")}
    plan = [(0, "p"), (1, "q"), (2, "r"), (3, "s"), (4, "q"), (5, "p"), (6, "r"), (7, "q")]
    arrivals = [
        (
            float(at),
            request(f"{name}@{at}", 1, prompt=prompts[name], max_tokens=8, recorder=recorder),
        )
        for at, name in plan
    ]
    pod, _ = simulate(profile, arrivals)
    full, cached = 0.02 + 0.0002 * 320, 0.04
    prefill = {
        key: times[0] - float(key.split("@")[1]) for key, times in recorder.token_times.items()
    }
    assert prefill == {
        "p@0": exactly(full),
        "q@1": exactly(full),
        "r@2": exactly(full),
        "s@3": exactly(full),  # the pool is full of cached blocks: p's (oldest) are evicted
        "q@4": exactly(cached),  # q survived and is now the most recently used
        "p@5": exactly(full),  # p was evicted; r's blocks (now oldest) make room
        "r@6": exactly(full),  # r was evicted; s's blocks make room
        "q@7": exactly(cached),  # q is still there
    }
    stats = pod.engine.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (8 * 320, 2 * 319)


# -- output lengths, aborts ---------------------------------------------------------------------


def test_output_lengths_are_seeded_and_average_about_400_for_max_tokens_750() -> None:
    def draw(seed: int) -> list[int]:
        engine = Engine(POD, seed=seed)
        return [engine.add(SimRequest(str(i), PROMPT_17, 750), 0.0).target for i in range(4000)]

    lengths = draw(5)
    assert lengths == draw(5)
    assert lengths != draw(6)
    assert 390 <= sum(lengths) / len(lengths) <= 410
    assert min(lengths) >= 50 and max(lengths) <= 750


def test_max_tokens_caps_the_output_and_reports_length() -> None:
    engine = Engine(POD)
    capped = engine.add(SimRequest("c", PROMPT_17, 30, output_length=200), 0.0)
    natural = engine.add(SimRequest("n", PROMPT_17, 300, output_length=200), 0.0)
    assert (capped.target, capped.finish_reason) == (30, "length")
    assert (natural.target, natural.finish_reason) == (200, "stop")


def test_aborting_frees_the_queue_and_the_blocks() -> None:
    engine = Engine(POD.with_changes(max_num_seqs=1))
    running = engine.add(SimRequest("r", PROMPT_17, 100, output_length=50), 0.0)
    waiting = engine.add(SimRequest("w", PROMPT_17, 100, output_length=50), 0.0)
    assert engine.start_step(0.0) == exactly(0.04)
    engine.finish_step(0.04)
    assert (running.phase, waiting.phase) == (Phase.RUNNING, Phase.WAITING)
    engine.abort(waiting)
    assert waiting.finished and waiting.finish_reason == "abort"
    assert not engine.waiting
    duration = engine.start_step(0.04)
    assert duration == exactly(0.0542)
    engine.abort(running)  # mid-step: dropped when the step ends
    engine.finish_step(0.04 + 0.0542)
    assert running.finished and running.finish_reason == "abort"
    assert running.generated == 1
    assert not engine.has_work
    assert engine.snapshot().kv_cache_usage == 0.0
    assert engine.stats.finished == {}


def test_gauges_change_at_step_ends_as_vllm_logs_them() -> None:
    loop = VirtualLoop()
    pod = VirtualPod(loop, POD, name="test")
    pod.submit(request("a", 3))
    assert pod.snapshot().running == 0  # nothing logged before the first step ends
    loop.run(until=0.04)
    assert (pod.snapshot().running, pod.snapshot().at) == (1, exactly(0.04))
    assert pod.snapshot().kv_cache_usage == exactly(2 / 700)
    loop.run()
    assert (pod.snapshot().running, pod.snapshot().kv_cache_usage) == (0, 0.0)
