"""The decision span: parent, attributes, events, the response closing the loop."""

from __future__ import annotations

import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
from opentelemetry.trace import SpanKind, StatusCode
from telemetry_support import Spans, pods, request, router_for

from policyd.fields.prefix_match import PrefixMatch
from policyd.policy import Router
from policyd.policy.loader import load_policy_set
from policyd.pool.pod import Pod
from policyd.telemetry import DecisionTelemetry
from policyd.telemetry import attributes as a
from policyd.telemetry.exchange_end import ExchangeEnd

ENVOY_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
ENVOY_SPAN = "00f067aa0ba902b7"
CARRIER = {"traceparent": f"00-{ENVOY_TRACE}-{ENVOY_SPAN}-01"}


def telemetry(spans: Spans) -> DecisionTelemetry:
    return DecisionTelemetry(tracer=spans.tracer)


def routed_end(record: object, **overrides: object) -> None:
    figures: dict[str, object] = {
        "completed": True,
        "duration_seconds": 0.5,
        "first_body_seconds": 0.125,
        "prompt_tokens": 12,
        "completion_tokens": 7,
    }
    figures.update(overrides)
    record.end(ExchangeEnd(**figures))  # type: ignore[arg-type]


def test_the_span_is_parented_on_the_carrier_and_its_context_goes_upstream(
    tmp_path: Path, spans: Spans
) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry(spans).start(request(), decision, CARRIER, 0.002)
    record.after_reply(router.decide_shadows(decision))
    routed_end(record)
    span = spans.only()
    assert span.context is not None and span.parent is not None
    assert f"{span.context.trace_id:032x}" == ENVOY_TRACE
    assert f"{span.parent.span_id:016x}" == ENVOY_SPAN
    assert record.upstream_headers == {
        "traceparent": f"00-{ENVOY_TRACE}-{span.context.span_id:016x}-01"
    }
    assert span.kind is SpanKind.INTERNAL
    assert span.name == "chat llama"  # GenAI: "{operation} {model}"


def test_without_a_carrier_the_span_is_a_new_root(tmp_path: Path, spans: Spans) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry(spans).start(request(), decision, {}, 0.001)
    record.after_reply(router.decide_shadows(decision))
    routed_end(record)
    span = spans.only()
    assert span.parent is None
    assert span.context is not None
    assert f"{span.context.trace_id:032x}" != ENVOY_TRACE


def test_the_decision_attributes(tmp_path: Path, spans: Spans) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    assert decision.pod == "a"  # the freest KV cache among the short queues
    started = time.time_ns()
    record = telemetry(spans).start(request(), decision, CARRIER, 0.25)
    record.after_reply(router.decide_shadows(decision))
    routed_end(record)
    span = spans.only()
    attributes = dict(span.attributes or {})
    policy = router.store.current.policies[0]
    assert attributes[a.GEN_AI_OPERATION] == "chat"
    assert attributes[a.GEN_AI_REQUEST_MODEL] == "llama"
    assert attributes[a.GEN_AI_REQUEST_MAX_TOKENS] == 64
    assert attributes[a.SERVER_ADDRESS] == "10.0.0.1"
    assert attributes[a.SERVER_PORT] == 8000
    assert attributes[a.POLICY] == "live"
    assert attributes[a.POLICY_VERSION] == policy.version
    assert attributes[a.TARGET_MODEL] == "llama"
    assert attributes[a.CRITICALITY] == "standard"
    assert attributes[a.REQUEST_ID] == "req-1"
    assert attributes[a.PROMPT_TOKENS] == 12
    assert attributes[a.CANDIDATES] == 3
    assert attributes[a.SURVIVORS] == 2
    assert attributes[a.OUTCOME] == "routed"
    assert attributes[a.POD] == "a"
    assert attributes[a.ENDPOINT] == "10.0.0.1:8000"
    assert attributes[a.FALLBACKS] == ("10.0.0.2:8000",)
    assert attributes[a.SCORE] == 0.9
    assert attributes[a.SCORED_PODS] == ("a", "b")
    assert attributes[a.SCORED_VALUES] == (0.9, 0.4)
    assert attributes[a.DECISION_DURATION] == 0.25
    # The span starts when the decision did.
    assert span.start_time is not None
    assert started - 300_000_000 < span.start_time < started - 200_000_000
    assert span.status.status_code is StatusCode.UNSET


def test_the_walk_is_one_attribute(tmp_path: Path, spans: Spans) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    routed_end(record)
    span = spans.only()
    attributes = dict(span.attributes or {})
    assert attributes[a.WALK] == "short queue (keep) 3\u21922 on_success > score (score) 2"
    assert a.WALK_ERRORS not in attributes and a.WALK_FIRST_ERROR not in attributes
    assert [e.name for e in span.events] == [a.SHADOW_EVENT]  # no event per node


def test_the_walk_counts_cel_errors_and_names_the_first(tmp_path: Path, spans: Spans) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    failing = replace(decision.trace[0], errors=(("a", "no such key"), ("b", "overflow")))
    decision = replace(decision, trace=(failing, *decision.trace[1:]))
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    routed_end(record)
    attributes = dict(spans.only().attributes or {})
    assert attributes[a.WALK].startswith("short queue (keep) 3\u21922 on_success [2 errors] > ")
    assert attributes[a.WALK_ERRORS] == 2
    assert attributes[a.WALK_FIRST_ERROR] == "a: no such key"


def test_the_response_closes_the_loop_when_it_ends(tmp_path: Path, spans: Spans) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    record.response_headers(200, 0.05)
    assert spans.finished() == ()  # still open while the response streams
    routed_end(record)
    attributes = dict(spans.only().attributes or {})
    assert attributes[a.HTTP_STATUS] == 200
    assert attributes[a.TIME_TO_HEADERS] == 0.05
    assert attributes[a.TIME_TO_FIRST_TOKEN] == 0.125
    assert attributes[a.RESPONSE_DURATION] == 0.5
    assert attributes[a.RESPONSE_COMPLETED] is True
    assert attributes[a.GEN_AI_INPUT_TOKENS] == 12
    assert attributes[a.GEN_AI_OUTPUT_TOKENS] == 7


def test_the_span_ends_when_the_response_ended_not_when_end_is_called(
    tmp_path: Path, spans: Spans
) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    before = time.time_ns()
    record = telemetry(spans).start(request(), decision, CARRIER, 0.25)
    after = time.time_ns()
    record.after_reply(router.decide_shadows(decision))
    # The serving path reports the end when it settles, after the response ended.
    routed_end(record, duration_seconds=0.5)
    span = spans.only()
    assert span.start_time is not None and span.end_time is not None
    assert span.end_time - span.start_time == 750_000_000  # the decision, then the response
    assert before + 500_000_000 <= span.end_time <= after + 500_000_000


def test_an_error_replys_span_ends_with_the_exchange_not_with_its_settlement(
    tmp_path: Path, spans: Spans
) -> None:
    busy = [Pod("c", "10.0.0.3:8000", waiting_queue=30)]
    router = router_for(tmp_path)
    decision = router.decide(request(), busy)
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    record.response_headers(429, 0.0)
    time.sleep(0.01)  # the exchange ended, its bookkeeping runs later
    routed_end(record, first_body_seconds=None, duration_seconds=0.002)
    span = spans.only()
    assert span.start_time is not None and span.end_time is not None
    assert span.end_time - span.start_time == 3_000_000  # the decision and its answer only


def test_a_server_error_from_the_pod_marks_the_span(tmp_path: Path, spans: Spans) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    record.response_headers(503, 0.01)
    routed_end(record, first_body_seconds=None, completion_tokens=None, prompt_tokens=None)
    span = spans.only()
    assert span.status.status_code is StatusCode.ERROR
    attributes = dict(span.attributes or {})
    assert attributes[a.ERROR_TYPE] == "503"
    assert a.TIME_TO_FIRST_TOKEN not in attributes
    assert a.GEN_AI_OUTPUT_TOKENS not in attributes


def test_a_shed_requests_span_says_why_and_what_was_answered(tmp_path: Path, spans: Spans) -> None:
    # (That its record waits for the error reply to go out is the exchange's
    # to ensure: tests/extproc/test_exchange_state.py.)
    busy = [Pod("c", "10.0.0.3:8000", waiting_queue=30)]
    router = router_for(tmp_path)
    decision = router.decide(request(), busy)
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    record.response_headers(429, 0.0)
    routed_end(record, completed=True, first_body_seconds=None)
    span = spans.only()
    attributes = dict(span.attributes or {})
    assert attributes[a.OUTCOME] == "shed"
    assert attributes[a.REASON] == "every pod is queueing too much"
    assert attributes[a.ERROR_TYPE] == "shed"
    assert attributes[a.HTTP_STATUS] == 429
    assert a.POD not in attributes and a.SERVER_ADDRESS not in attributes
    assert "(keep)" in attributes[a.WALK] and "(shed)" in attributes[a.WALK]


def test_a_stream_gone_before_the_response_ended_is_not_completed(
    tmp_path: Path, spans: Spans
) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    routed_end(record, completed=False, first_body_seconds=None)
    span = spans.only()
    attributes = dict(span.attributes or {})
    assert attributes[a.RESPONSE_COMPLETED] is False
    assert attributes[a.POD] == "a"  # the decision is recorded all the same


def test_shadow_policies_are_recorded_with_their_agreement(tmp_path: Path, spans: Spans) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    assert decision.shadow_inputs is not None
    record.after_reply(router.decide_shadows(decision))
    routed_end(record)
    span = spans.only()
    attributes = dict(span.attributes or {})
    assert attributes[a.SHADOWS] == 1
    assert attributes[a.SHADOWS_AGREED] == 0
    (shadow,) = [dict(e.attributes or {}) for e in span.events if e.name == a.SHADOW_EVENT]
    assert shadow == {
        a.SHADOW_POLICY: "fewest-waiting",
        a.SHADOW_VERSION: router.store.current.policies[0].shadows[0].version,
        a.SHADOW_OUTCOME: "routed",
        a.SHADOW_POD: "b",
        a.SHADOW_ENDPOINT: "10.0.0.2:8000",
        a.SHADOW_AGREEMENT: "other-pod",
        a.SHADOW_AGREES: False,
    }


def test_large_pools_and_trees_stay_within_bounds(tmp_path: Path, spans: Spans) -> None:
    chain = "\n".join(
        f"  n{i}:\n    keep: pod.waiting_queue < {100 - i}\n    next: n{i + 1}" for i in range(40)
    )
    live = (
        f"name: long\nfilters:\n{chain}\n  n40:\n    keep: 'true'\n"
        "score:\n  q:\n    expr: 1.0 - pod.kv_cache\n"
    )
    path = tmp_path / "long.yaml"
    path.write_text(textwrap.dedent(live))
    router = Router(load_policy_set(path))
    many = [Pod(f"p{i}", f"10.1.0.{i}:8000", kv_cache=i / 200) for i in range(100)]
    decision = router.decide(request(), many)
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    routed_end(record)
    span = spans.only()
    attributes = dict(span.attributes or {})
    assert span.events == ()
    walk = attributes[a.WALK]
    assert isinstance(walk, str) and walk.startswith("n0 (keep) 100\u2192")
    assert len(walk) == a.MAX_WALK and walk.endswith(" chars]")  # cut, and says so
    assert len(attributes[a.SCORED_PODS]) <= a.MAX_LISTED_PODS  # type: ignore[arg-type]


def test_a_trace_the_sampler_dropped_still_carries_its_context_upstream(
    tmp_path: Path, spans: Spans
) -> None:
    unsampled = {"traceparent": f"00-{ENVOY_TRACE}-{ENVOY_SPAN}-00"}
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry(spans).start(request(), decision, unsampled, 0.001)
    record.after_reply(router.decide_shadows(decision))
    routed_end(record)
    assert spans.finished() == ()  # parent-based sampling: not recorded
    version, trace_id, _, flags = record.upstream_headers["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", ENVOY_TRACE, "00")


@pytest.mark.parametrize(
    "traceparent",
    [
        "",
        "garbage",
        f"ff-{ENVOY_TRACE}-{ENVOY_SPAN}-01",  # version ff is invalid
        f"00-{'0' * 32}-{ENVOY_SPAN}-01",  # all-zero trace id
        f"00-{ENVOY_TRACE}-{'0' * 16}-01",  # all-zero span id
        f"00-{ENVOY_TRACE[:-1]}x-{ENVOY_SPAN}-01",  # not hex
        f"00-{ENVOY_TRACE}-{ENVOY_SPAN}-01-extra",  # version 00 has exactly four parts
    ],
)
def test_a_malformed_traceparent_starts_a_new_trace(
    tmp_path: Path, spans: Spans, traceparent: str
) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry(spans).start(request(), decision, {"traceparent": traceparent}, 0.0)
    routed_end(record, completed=False)
    span = spans.only()
    assert span.parent is None


def test_the_parents_tracestate_is_carried_on(tmp_path: Path, spans: Spans) -> None:
    carrier = {**CARRIER, "tracestate": "vendor=abc"}
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry(spans).start(request(), decision, carrier, 0.0)
    assert record.upstream_headers["tracestate"] == "vendor=abc"
    routed_end(record, completed=False)
    assert spans.only().parent is not None


def test_a_prefix_policy_records_the_chosen_and_best_match_and_the_cached_tokens(
    tmp_path: Path, spans: Spans
) -> None:
    class Matcher:
        def match(self, model: str, candidates: object) -> list[PrefixMatch]:
            return [PrefixMatch(0.25, 64), PrefixMatch(0.75, 192), PrefixMatch(0.5, 128)]

    prefix_policy = """\
        name: live
        score:
          locality:
            weight: 1
            expr: pod.prefix_match
          short queue:
            weight: 1
            expr: 1.0 - double(pod.waiting_queue) / 10.0
        pick:
          strategy: max-score
        """
    (tmp_path / "live.yaml").write_text(textwrap.dedent(prefix_policy))
    router = Router(load_policy_set(tmp_path / "live.yaml"))
    decision = router.decide(request(), pods(), Matcher())
    assert decision.pod == "b"
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    record.response_headers(200, 0.05)
    routed_end(record, cached_tokens=160)
    attributes = dict(spans.only().attributes or {})
    assert attributes[a.PREFIX_MATCH] == 0.75
    assert attributes[a.BEST_PREFIX_MATCH] == 0.75
    assert attributes[a.GEN_AI_CACHED_TOKENS] == 160


def test_a_policy_without_prefix_fields_records_no_prefix_attributes(
    tmp_path: Path, spans: Spans
) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    routed_end(record)
    attributes = dict(spans.only().attributes or {})
    assert not {a.PREFIX_MATCH, a.BEST_PREFIX_MATCH, a.GEN_AI_CACHED_TOKENS} & set(attributes)


def test_a_held_request_records_its_time_held_and_queue_position(
    tmp_path: Path, spans: Spans
) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    decision.held_seconds, decision.queue_position = 1.25, 7  # as flow control set them
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    routed_end(record)
    attributes = dict(spans.only().attributes or {})
    assert (attributes[a.FLOW_HELD], attributes[a.FLOW_QUEUE_POSITION]) == (1.25, 7)


def test_a_request_never_held_records_no_flow_attributes(tmp_path: Path, spans: Spans) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    record = telemetry(spans).start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    routed_end(record)
    assert not {a.FLOW_HELD, a.FLOW_QUEUE_POSITION} & set(spans.only().attributes or {})


def test_the_span_leaves_token_usage_to_the_model_servers_span_when_told(
    tmp_path: Path, spans: Spans
) -> None:
    router = router_for(tmp_path)
    decision = router.decide(request(), pods())
    telemetry = DecisionTelemetry(tracer=spans.tracer, span_usage=False)
    record = telemetry.start(request(), decision, CARRIER, 0.001)
    record.after_reply(router.decide_shadows(decision))
    record.response_headers(200, 0.05)
    routed_end(record, cached_tokens=8)
    attributes = dict(spans.only().attributes or {})
    assert not [name for name in attributes if name.startswith("gen_ai.usage.")]
    assert attributes[a.GEN_AI_PROVIDER] == "openai"  # the rest of the span is unchanged


def test_each_api_names_its_operation_and_provider() -> None:
    assert a.operation("/v1/chat/completions") == ("chat", "openai")
    assert a.operation("/v1/completions") == ("text_completion", "openai")
    assert a.operation("/v1/embeddings") == ("embeddings", "openai")
    assert a.operation("/v1/messages") == ("chat", "anthropic")
    assert a.operation("/v1/responses") == ("chat", "openai")
    assert a.operation("/generate") == ("inference", "openai")
