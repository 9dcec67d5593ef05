"""Prefill and decode roles in the engine (vLLM V1 with a NixlConnector), in virtual time.

A prefill-only request (``remote_decode``) writes one token and keeps its prompt
blocks for its decode pod; a ``remote_prefill`` request waits for its prompt's KV
(``Profile.kv_transfer_s``: setup plus bytes over bandwidth) with the blocks
taken, computes only the last prompt token, and never holds up the pod's other
requests while the KV arrives.
"""

from __future__ import annotations

import itertools
import math

import pytest

from policyd.sim.blocks import BlocksStored
from policyd.sim.engine import RemotePrefill, RequestState, SimRequest
from policyd.sim.profile import H100_LLAMA31_8B, L4_LLAMA2_7B, L4_LLAMA31_8B
from policyd.sim.virtual import VirtualLoop, VirtualPod

# One GB/s and 10 ms of setup: 1,000 Llama-3.1-8B tokens (131 MB) take 0.141 s.
PROFILE = H100_LLAMA31_8B.with_changes(kv_transfer_bytes_per_s=1e9, kv_transfer_setup_s=0.01)
BLOCK = PROFILE.block_size
REMOTE = RemotePrefill("prefill-engine", (1, 2, 3), "10.0.0.1", 5600)


def prompt(length: int, start: int = 100) -> tuple[int, ...]:
    return tuple(range(start, start + length))


def request(name: str, tokens: tuple[int, ...], out: int = 4, **kv: object) -> SimRequest:
    return SimRequest(name, tokens, max_tokens=out, output_length=out, **kv)  # type: ignore[arg-type]


class Tokens:
    """When every token of every request came out."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def on_progress(self, state: RequestState, now: float) -> None:
        times = self.times.setdefault(state.request.request_id, [])
        times.extend([now] * (state.generated - len(times)))


def test_the_llama_3_1_8b_profiles_declare_its_kv_bytes_per_token() -> None:
    # 32 layers x 8 KV heads x 128 dimensions x (K and V) x 2 bytes.
    assert H100_LLAMA31_8B.kv_bytes_per_token == L4_LLAMA31_8B.kv_bytes_per_token == 131072
    assert L4_LLAMA2_7B.kv_bytes_per_token == 4 * 131072  # 32 KV heads, no GQA
    assert PROFILE.kv_transfer_s(1000) == pytest.approx(0.01 + 1000 * 131072 / 1e9)


def test_a_remote_prefill_waits_for_the_transfer_and_computes_only_the_last_token() -> None:
    loop = VirtualLoop()
    pod = VirtualPod(loop, PROFILE, name="decode")
    state = pod.submit(request("d", prompt(1000), remote_prefill=REMOTE))
    loop.run()
    transfer = PROFILE.kv_transfer_s(1000)
    # The first step computes one prompt token over the 999 arrived ones.
    assert state.first_token_at == pytest.approx(transfer + PROFILE.step_s(1, 0, 999))
    local_loop = VirtualLoop()
    local_state = VirtualPod(local_loop, PROFILE, name="local").submit(request("l", prompt(1000)))
    local_loop.run()
    assert local_state.first_token_at == pytest.approx(PROFILE.step_s(1000, 0, 0))
    assert state.generated == 4 and state.finished


def test_the_transfer_overlaps_the_other_requests_steps_and_holds_its_blocks() -> None:
    loop = VirtualLoop()
    pod = VirtualPod(loop, PROFILE, name="decode")
    tokens = Tokens()
    busy = pod.submit(
        SimRequest("busy", prompt(100, 5000), 200, output_length=200, listener=tokens)
    )
    seen: dict[str, float] = {}
    remote: list[RequestState] = []
    loop.call_at(
        0.05, lambda: remote.append(pod.submit(request("d", prompt(1000), remote_prefill=REMOTE)))
    )

    def look() -> None:
        snapshot = pod.snapshot()
        seen.update(waiting=snapshot.waiting, usage=snapshot.kv_cache_usage)

    transfer = PROFILE.kv_transfer_s(1000)
    loop.call_at(0.05 + transfer / 2, look)
    loop.run()
    busy_blocks = math.ceil((100 + 200) / BLOCK)
    # Mid-transfer: counted as waiting, its 63 blocks taken next to the busy request's.
    assert seen["waiting"] == 1
    assert seen["usage"] >= (math.ceil(1000 / BLOCK) + 1) / PROFILE.num_gpu_blocks
    assert seen["usage"] <= (math.ceil(1000 / BLOCK) + busy_blocks) / PROFILE.num_gpu_blocks
    times = tokens.times["busy"]
    during = [t for t in times if 0.05 < t < 0.05 + transfer]
    # The busy request kept decoding all along: no gap near the transfer's length.
    assert len(during) >= transfer / PROFILE.step_s(0, 2, 1200) - 1
    assert max(b - a for a, b in itertools.pairwise(times)) < transfer / 4
    assert busy.finished and remote[0].finished
    assert remote[0].first_token_at is not None
    assert remote[0].first_token_at >= 0.05 + transfer


def test_the_decode_pod_announces_the_blocks_it_received() -> None:
    loop = VirtualLoop()
    decode = VirtualPod(loop, PROFILE, name="decode")
    prefill = VirtualPod(loop, PROFILE, name="prefill")
    decode.engine.record_kv_events()
    prefill.engine.record_kv_events()
    decode.submit(request("d", prompt(1000), remote_prefill=REMOTE))
    prefill.submit(request("p", prompt(1000), out=1, remote_decode=True))
    loop.run()

    def stored(pod: VirtualPod) -> list[int]:
        events = pod.engine.take_kv_events()
        return [h for e in events if isinstance(e, BlocksStored) for h in e.block_hashes]

    prompt_blocks = 1000 // BLOCK  # full blocks
    on_prefill, on_decode = stored(prefill), stored(decode)
    assert on_prefill[:prompt_blocks] == on_decode[:prompt_blocks]
    assert len(on_decode) >= prompt_blocks


def test_a_prefill_for_a_remote_decode_writes_one_token_and_keeps_its_blocks() -> None:
    loop = VirtualLoop()
    pod = VirtualPod(loop, PROFILE, name="prefill")
    state = pod.submit(request("p", prompt(1000), out=50, remote_decode=True))
    loop.run(until=PROFILE.step_s(1000, 0, 0) + 0.001)
    assert state.finished and state.generated == 1 and state.finish_reason == "length"
    assert len(state.sent_blocks) == math.ceil(1000 / BLOCK)
    assert pod.engine.has_work  # the blocks wait for the decode pod
    assert pod.engine.next_due() == pytest.approx(
        PROFILE.step_s(1000, 0, 0) + PROFILE.kv_transfer_s(1000)
    )
    loop.run()
    assert not pod.engine.has_work
    assert loop.now == pytest.approx(PROFILE.step_s(1000, 0, 0) + PROFILE.kv_transfer_s(1000))
    # Then they stay cached: the same prompt again computes only its tail.
    again = pod.submit(request("again", prompt(1000), out=1))
    loop.run()
    assert again.cached_tokens == (1000 - 1) // BLOCK * BLOCK


def test_blocks_the_decode_pod_holds_are_not_transferred() -> None:
    loop = VirtualLoop()
    pod = VirtualPod(loop, PROFILE, name="decode")
    pod.submit(request("warm", prompt(512), out=1))
    loop.run()
    start = loop.now
    state = pod.submit(request("d", prompt(1000), remote_prefill=REMOTE))
    loop.run()
    assert state.cached_tokens == 512
    transferred = pod.engine.stats.nixl_bytes_transferred
    assert (transferred.count, transferred.total) == (1, (1000 - 512) * 131072)
    assert state.first_token_at == pytest.approx(
        start + PROFILE.kv_transfer_s(1000 - 512) + PROFILE.step_s(1, 0, 999)
    )


def test_an_aborted_transfer_frees_its_blocks() -> None:
    loop = VirtualLoop()
    pod = VirtualPod(loop, PROFILE, name="decode")
    state = pod.submit(request("d", prompt(1000), remote_prefill=REMOTE))
    loop.run(until=0.05)
    assert pod.engine.transferring == [state]
    pod.abort(state)
    assert state.finished and not pod.engine.has_work
    loop.run()
    assert state.generated == 0


def test_a_v0_pod_has_no_kv_connector() -> None:
    pod = VirtualPod(VirtualLoop(), L4_LLAMA2_7B, name="v0")
    with pytest.raises(ValueError, match="P/D needs vLLM V1"):
        pod.submit(request("d", prompt(100), remote_prefill=REMOTE))
    with pytest.raises(ValueError, match="P/D needs vLLM V1"):
        pod.submit(request("p", prompt(100), remote_decode=True))
