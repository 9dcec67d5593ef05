"""What the demo's table says about a decision."""

from __future__ import annotations

from policyd.demo.feed import DecisionFeed, explain
from policyd.demo.view import decision_line
from policyd.policy.decision import Decision, NodeTrace, Outcome
from policyd.policy.request import Request
from policyd.telemetry.exchange_end import ExchangeEnd


def routed(
    trace: tuple[NodeTrace, ...],
    survivors: tuple[str, ...],
    *,
    score: float | None = None,
    prefix_match: float | None = None,
) -> Decision:
    return Decision(
        Outcome.ROUTED, "p", "v", "adapter-1", "127.0.0.1:1", survivors[0],
        trace=trace, survivors=survivors, score=score, prefix_match=prefix_match,
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
        ExchangeEnd(
            completed=True, duration_seconds=0.5, first_body_seconds=0.02,
            prompt_tokens=5, completion_tokens=9,
        )
    )  # fmt: skip
    line = decision_line(span.record)
    assert line.split()[:5] == ["r007", "adapter-1~", "std", "vllm-2", "200"]
    assert "20ms" in line and "500ms" in line
    assert line.split()[8] == "all"  # no prefix column: the policy does not read it
    assert feed.totals.by_status[200] == 1
    assert feed.totals.stream_ttft_seconds == [0.02]
    assert feed.totals.by_model_pod[("adapter-1", "vllm-2")] == 1


def test_the_table_shows_the_chosen_pods_prefix_match() -> None:
    feed = DecisionFeed()
    request = Request(model="adapter-1", headers={"x-demo-request": "r008"})
    span = feed.start(request, routed((), ("vllm-2",), prefix_match=0.9312), {}, 0.0001)
    assert decision_line(span.record).split()[4:7] == ["…", "0.93", "all"]
