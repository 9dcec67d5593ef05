"""The demo's summary and its side-by-side with random routing, from feeds filled by hand."""

from __future__ import annotations

import pytest

from policyd.demo.feed import DecisionFeed
from policyd.demo.traffic import TrafficResults
from policyd.demo.view import RunFigures, compare, comparison, run_figures, summary
from policyd.policy.decision import Decision, Outcome
from policyd.policy.request import Request
from policyd.telemetry.exchange_end import ExchangeEnd

PODS = ("vllm-0", "vllm-1", "vllm-2")


def answer(
    feed: DecisionFeed,
    model: str,
    pod: str,
    *,
    prompt: int = 100,
    cached: int = 0,
    ttft: float | None = None,
    completed: bool = True,
) -> None:
    request = Request(model=model, stream=ttft is not None)
    decision = Decision(Outcome.ROUTED, "p", "v", model, "127.0.0.1:1", pod, survivors=(pod,))
    span = feed.start(request, decision, {}, 0.0001)
    span.response_headers(200, 0.01)
    span.end(
        ExchangeEnd(
            completed=completed, duration_seconds=1.0, first_body_seconds=ttft,
            prompt_tokens=prompt, completion_tokens=10, cached_tokens=cached,
        )
    )  # fmt: skip


def test_the_figures_of_a_run() -> None:
    feed = DecisionFeed()
    for i in range(10):  # adapter-a stays on vllm-0; streams' TTFT 10, 20, ... 100 ms
        answer(feed, "adapter-a", "vllm-0", cached=80 if i else 0, ttft=(i + 1) / 100)
    answer(feed, "adapter-b", "vllm-1")
    answer(feed, "adapter-b", "vllm-2", completed=False)  # policyd lost the stream
    answer(feed, "base", "vllm-1")  # not an adapter: no spread
    traffic = TrafficResults(sent=13, finished=13, completed=12)  # what the clients saw
    figures = run_figures("lora-prefix", feed, traffic, PODS, ("adapter-a", "adapter-b"))
    assert figures.completed == 12
    assert figures.ttft_p50_s == pytest.approx(0.055)
    assert figures.ttft_p90_s == pytest.approx(0.09)
    assert figures.hit_rate == pytest.approx(720 / 1300)
    assert figures.adapter_pods == pytest.approx((1 + 2) / 2)
    assert figures.busiest_over_mean == pytest.approx(10 / (13 / 3))


def test_a_run_without_streams_adapters_or_usage_has_no_such_figures() -> None:
    feed = DecisionFeed()
    answer(feed, "base", "vllm-0", prompt=0)
    figures = run_figures("random", feed, TrafficResults(), PODS, ("adapter-a",))
    assert (figures.ttft_p50_s, figures.hit_rate, figures.adapter_pods) == (None, None, None)


@pytest.mark.parametrize(
    ("value", "baseline", "words"),
    [
        (200, 200, "same"),
        (20, 50, "2.5x lower"),
        (81, 27, "3.0x higher"),
        (1.26, 1.30, "same"),  # within 5%
        (30, 0, "higher"),
        (None, 5, ""),
    ],
)
def test_a_figure_compared_with_randoms_in_words(
    value: float | None, baseline: float, words: str
) -> None:
    assert compare(value, baseline) == words


def test_the_side_by_side_names_both_policies_and_how_they_compare() -> None:
    ours = RunFigures("lora-prefix", 200, 0.014, 0.060, 0.63, 2.0, 1.26)
    random = RunFigures("random", 198, 0.037, 0.814, 0.25, 4.5, 1.32)
    lines = comparison([ours, random], time_scale=5)
    assert lines[0].split() == ["lora-prefix", "random"]
    rows = {line[:26].strip(): line[26:].split() for line in lines[1:-1]}
    assert rows == {
        "completed": ["200", "198", "same"],
        "TTFT p50 (streams)": ["14", "ms", "37", "ms", "2.6x", "lower"],
        "TTFT p90 (streams)": ["60", "ms", "814", "ms", "13.6x", "lower"],
        "prefix-cache hit rate": ["63%", "25%", "2.5x", "higher"],
        "pods per adapter": ["2.0", "4.5", "2.2x", "lower"],
        "busiest pod / mean": ["1.26", "1.32", "same"],
    }
    alone = comparison([RunFigures("lora-prefix", 5, None, None, None, None, None)], time_scale=5)
    assert alone[1].split() == ["completed", "5"]
    assert alone[2].split() == ["TTFT", "p50", "(streams)", "-"]


def test_the_summary_counts_answers_pods_and_cached_tokens() -> None:
    feed = DecisionFeed()
    answer(feed, "base", "vllm-0", prompt=100, cached=64)
    answer(feed, "base", "vllm-2", prompt=50, cached=0)
    traffic = TrafficResults(sent=2, finished=2)
    traffic.statuses[200] = 2
    lines = summary(feed, traffic, seconds=3.2, pod_names=PODS)
    assert lines[0].startswith("summary: 2 requests in 3.2 s")
    assert lines[1].split() == ["answers", "200", "x2"]
    assert lines[2].split() == ["per", "pod", "vllm-0", "1", "vllm-1", "0", "vllm-2", "1"]
    assert "150 prompt tokens of which 64 came from the pods' prefix caches" in lines[3]
