"""What the demo's table says about a decision, and the affinity figure of its summary."""

from __future__ import annotations

import pytest

from policyd.demo.feed import DecisionFeed, explain
from policyd.demo.view import adapter_spread, decision_line
from policyd.policy.decision import Decision, NodeTrace, Outcome
from policyd.policy.request import Request


def routed(trace: tuple[NodeTrace, ...], survivors: tuple[str, ...], **more: object) -> Decision:
    return Decision(
        Outcome.ROUTED, "p", "v", "adapter-1", "127.0.0.1:1", survivors[0],
        trace=trace, survivors=survivors, **more,
    )  # fmt: skip


def test_the_why_names_the_nodes_that_narrowed_and_the_pick() -> None:
    trace = (
        NodeTrace("critical request", "if", 6, (), branch="else"),
        NodeTrace("has capacity", "keep", 6, ("a", "b", "c", "d", "e", "f"), narrows=True),
        NodeTrace("low-cost lora", "keep", 6, ("a", "b"), narrows=True),
        NodeTrace("least kv cache", "band", 2, ("a",), narrows=True),
    )
    assert explain(routed(trace, ("a",))) == (
        "low-cost lora 6→2 > least kv cache 2→1 · the only one left"
    )


def test_a_node_that_kept_none_is_shown_handing_its_input_on() -> None:
    trace = (
        NodeTrace(
            "lora affinity", "keep", 6, (), branch="on_failure", next="can accept", narrows=True
        ),
        NodeTrace("can accept", "keep", 6, ("a", "b", "c"), narrows=True),
    )
    assert explain(routed(trace, ("a", "b", "c"))) == (
        "lora affinity: none of 6 > can accept 6→3 · random of 3"
    )


def test_a_scored_pick_and_an_answer_policyd_gave_itself() -> None:
    assert explain(routed((), ("a", "b"), score=2.5)) == "all 2 pass · best score 2.50 of 2"
    shed = Decision(Outcome.SHED, "p", "v", "m", reason="dropping request")
    assert explain(shed) == "dropping request"


def test_the_feed_follows_a_request_to_its_end() -> None:
    feed = DecisionFeed()
    request = Request(model="adapter-1", headers={"x-demo-request": "r007"}, stream=True)
    span = feed.start(request, routed((), ("vllm-2",)), {}, 0.0001)
    assert "…" in decision_line(span.record)  # still on its way
    span.response_headers(200, 0.01)
    span.end(
        completed=True, duration_seconds=0.5, first_body_seconds=0.02,
        prompt_tokens=5, completion_tokens=9,
    )  # fmt: skip
    line = decision_line(span.record)
    assert line.split()[:5] == ["r007", "adapter-1~", "std", "vllm-2", "200"]
    assert "20ms" in line and "500ms" in line
    assert feed.totals.by_status[200] == 1
    assert feed.totals.stream_ttft_seconds == [0.02]
    assert feed.totals.by_model_pod[("adapter-1", "vllm-2")] == 1


@pytest.mark.parametrize(
    ("spread", "observed"),
    [({"vllm-0": 4}, 1.0), ({"vllm-0": 2, "vllm-1": 2}, 2.0)],
)
def test_the_affinity_figure_compares_with_uniform_random_routing(
    spread: dict[str, int], observed: float
) -> None:
    feed = DecisionFeed()
    for pod, count in spread.items():
        feed.totals.by_model_pod[("adapter-1", pod)] += count
    feed.totals.by_model_pod[("base", "vllm-3")] += 5  # not an adapter: left out
    result = adapter_spread(feed, ["adapter-1"], pods=6)
    assert result is not None
    # 4 requests uniformly over 6 pods reach 6 * (1 - (5/6) ** 4) = 3.11 pods on average.
    assert result == (observed, pytest.approx(3.106, abs=1e-3))
