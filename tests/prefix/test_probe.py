"""A request's prefix match per pod, from the serving path's turns to the index and back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from policyd.extproc.openai import Turn
from policyd.fields.prefix_match import PrefixMatch
from policyd.prefix.events import decode_batch
from policyd.prefix.index import ApproximateIndex, PreciseIndex
from policyd.prefix.probe import PrefixLocator
from policyd.prefix.tokenizers import SimTokenizer, TurnLike
from policyd.sim.engine import Engine, RequestState, SimRequest
from policyd.sim.kv_events import encode_batch
from policyd.sim.profile import L4_LLAMA2_7B

BASE = L4_LLAMA2_7B.base_model
SYSTEM = Turn("system", (" ".join(f"rule{i}" for i in range(300)),))  # ~300 tokens


@dataclass(frozen=True)
class Pod:
    address: str


PODS = [Pod("10.0.0.1:8000"), Pod("10.0.0.2:8000"), Pod("10.0.0.3:8000")]


def chat(question: str) -> tuple[Turn, ...]:
    return (SYSTEM, Turn("user", (question,)))


class CountingTokenizer(SimTokenizer):
    def __init__(self) -> None:
        self.calls = 0

    def encode(self, turns: Sequence[TurnLike]) -> list[int]:
        self.calls += 1
        return super().encode(turns)


def run(engine: Engine, request: SimRequest, now: float) -> RequestState:
    state = engine.add(request, now)
    while not state.finished:
        duration = engine.start_step(now)
        assert duration is not None
        now += duration
        engine.finish_step(now)
    return state


def test_precise_mode_predicts_the_cached_tokens_the_simulated_pod_finds() -> None:
    engine = Engine(L4_LLAMA2_7B)
    engine.record_kv_events()
    tokenizer = SimTokenizer()
    index = PreciseIndex()
    locator = PrefixLocator(tokenizer, index, block_size=16)
    lora_ids = {"adapter-1": 1}

    def deliver() -> None:
        payload = encode_batch(engine.take_kv_events(), 0.0, 16, lora_ids)
        batch = decode_batch(payload, BASE)
        assert batch is not None
        index.apply(PODS[0].address, batch.events)

    first = chat("How do I reset my password?")
    run(engine, SimRequest("r1", tuple(tokenizer.encode(first)), 4), 0.0)
    run(engine, SimRequest("r2", tuple(tokenizer.encode(first)), 4, "adapter-1"), 10.0)
    deliver()

    second = chat("Where is my invoice?")
    probe = locator.probe(second)
    a, b, _ = probe.match(BASE, PODS)
    state = run(engine, SimRequest("r3", tuple(tokenizer.encode(second)), 4), 20.0)
    assert a.prefix_tokens == state.cached_tokens > 250
    assert a.prefix_match == pytest.approx(state.cached_tokens / len(probe.tokens))
    assert b == PrefixMatch(0.0, 0)
    # The adapter's blocks are its own: the same prompt under it matches its chain.
    adapter_fraction = locator.probe(first).match("adapter-1", PODS)[0].prefix_match
    assert adapter_fraction == pytest.approx(len(probe.tokens) // 16 * 16 / len(probe.tokens), 0.1)
    assert locator.mode == "precise"


def test_approximate_mode_learns_where_policyd_routed() -> None:
    locator = PrefixLocator(SimTokenizer(), ApproximateIndex(10_000), block_size=16)
    assert locator.mode == "approximate"
    first = locator.probe(chat("question one"))
    assert first.match(BASE, PODS) == [PrefixMatch(0.0, 0)] * 3
    first.routed(BASE, PODS[1].address)
    again = locator.probe(chat("question one")).match(BASE, PODS)
    prompt = len(first.tokens)
    assert again[1] == PrefixMatch(prompt // 16 * 16 / prompt, prompt // 16 * 16)
    other = locator.probe(chat("question two"))
    shared = other.match(BASE, PODS)[1].prefix_tokens
    assert 0 < shared < prompt and shared % 16 == 0
    assert other.match("adapter-1", PODS)[1] == PrefixMatch(0.0, 0)


def test_a_probe_tokenizes_once_and_only_when_asked() -> None:
    tokenizer = CountingTokenizer()
    index = ApproximateIndex(10_000)
    locator = PrefixLocator(tokenizer, index, block_size=16)
    idle = locator.probe(chat("never matched"))
    assert tokenizer.calls == 0 and idle is not None
    probe = locator.probe(chat("matched twice"))
    probe.match(BASE, PODS)
    probe.match("adapter-1", PODS[:1])
    probe.routed("adapter-1", PODS[0].address)
    assert tokenizer.calls == 1
    assert probe.keys(BASE, 16) is probe.keys(BASE, 16)


def test_an_empty_prompt_or_no_pods_match_nothing() -> None:
    locator = PrefixLocator(SimTokenizer(), ApproximateIndex(100), block_size=16)
    assert locator.probe(()).match(BASE, PODS) == [PrefixMatch(0.0, 0)] * 3
    assert locator.probe(chat("x")).match(BASE, []) == []
    with pytest.raises(ValueError, match="positive"):
        PrefixLocator(SimTokenizer(), ApproximateIndex(100), block_size=0)


def test_precise_mode_keys_each_pod_with_the_block_size_it_announced() -> None:
    tokenizer = SimTokenizer()
    index = PreciseIndex()
    locator = PrefixLocator(tokenizer, index, block_size=16)
    turns = chat("block sizes")
    tokens = tokenizer.encode(turns)
    for pod, size in ((PODS[0], 16), (PODS[1], 32)):
        engine = Engine(L4_LLAMA2_7B.with_changes(block_size=size))
        engine.record_kv_events()
        run(engine, SimRequest("r", tuple(tokens), 1), 0.0)
        batch = decode_batch(encode_batch(engine.take_kv_events(), 0.0, size, {}), BASE)
        assert batch is not None
        index.apply(pod.address, batch.events)
    matched = locator.probe(turns).match(BASE, PODS)
    assert [m.prefix_tokens for m in matched] == [
        len(tokens) // 16 * 16,
        len(tokens) // 32 * 32,
        0,
    ]
    assert sorted(index.block_sizes()) == [16, 32]
    index.forget(PODS[1].address)
    assert list(index.block_sizes()) == [16]
    matched = locator.probe(turns).match(BASE, PODS)
    assert [m.prefix_tokens for m in matched] == [len(tokens) // 16 * 16, 0, 0]
