"""The decision span and the metrics carry what the latency models predicted for the
chosen pod, the client's objectives, and, at the end, what the answer took and
whether each objective was met."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

from telemetry_support import Spans, pods, request

from policyd.latency.model import WARM
from policyd.latency.models import LatencyModels, Outcome
from policyd.policy import Router
from policyd.policy.loader import load_policy_set
from policyd.telemetry import DecisionTelemetry
from policyd.telemetry import attributes as a
from policyd.telemetry.exchange_end import ExchangeEnd
from policyd.telemetry.metrics import DecisionMetrics

HEADROOM = """\
    name: live
    score:
      headroom:
        weight: 1
        expr: request.slo_ttft_ms - pod.predicted_ttft_ms
    pick:
      strategy: max-score
    """
# 101 tokens: 250 ms to the first, then 20 ms each.
STREAMED = ExchangeEnd(True, 0.25 + 0.02 * 100, 0.25, 12, 101)


def predicting_router(tmp_path: Path) -> Router:
    models = LatencyModels()
    for pod in pods():
        ttft = {"a": 400.0, "b": 200.0, "c": 900.0}[pod.name]
        for _ in range(WARM + 4):
            models.learn(Outcome(pod, 0, 0, 12, 44, ttft, 25.0))
    (tmp_path / "live.yaml").write_text(textwrap.dedent(HEADROOM))
    return Router(load_policy_set(tmp_path / "live.yaml"), rng=random.Random(0), latency=models)


def test_the_span_carries_prediction_objective_and_outcome(tmp_path: Path, spans: Spans) -> None:
    router = predicting_router(tmp_path)
    asked = request(stream=True, slo_ttft_ms=300.0, slo_tpot_ms=15.0)
    decision = router.decide(asked, pods())
    assert decision.pod == "b"
    metrics = DecisionMetrics()
    record = DecisionTelemetry(tracer=spans.tracer, metrics=metrics).start(
        asked, decision, {}, 0.001
    )
    record.after_reply(None)
    record.response_headers(200, 0.05)
    record.end(STREAMED)
    attributes = dict(spans.only().attributes or {})
    assert abs(attributes[a.PREDICTED_TTFT] - 200.0) < 5.0
    assert abs(attributes[a.PREDICTED_TPOT] - 25.0) < 1.0
    assert attributes[a.SLO_TTFT] == 300.0 and attributes[a.SLO_TPOT] == 15.0
    assert abs(attributes[a.TIME_PER_OUTPUT_TOKEN] - 0.02) < 1e-9
    assert attributes[a.SLO_TTFT_MET] is True  # 250 ms <= 300 ms
    assert attributes[a.SLO_TPOT_MET] is False  # 20 ms > 15 ms
    r = metrics.registry
    labels = {"policy": "live", "model_name": "llama"}
    assert (
        r.get_sample_value(
            "policyd_slo_requests_total", {**labels, "objective": "ttft", "met": "true"}
        )
        == 1
    )
    assert (
        r.get_sample_value(
            "policyd_slo_requests_total", {**labels, "objective": "tpot", "met": "false"}
        )
        == 1
    )
    # Predicted 200 ms against 250: an error of about 0.2: within 0.3, not within 0.15.
    error = {**labels, "latency": "ttft"}
    assert (
        r.get_sample_value("policyd_latency_prediction_error_ratio_bucket", {**error, "le": "0.3"})
        == 1
    )
    assert (
        r.get_sample_value("policyd_latency_prediction_error_ratio_bucket", {**error, "le": "0.15"})
        == 0
    )


def test_without_predictions_or_objectives_the_span_has_none(tmp_path: Path, spans: Spans) -> None:
    (tmp_path / "plain.yaml").write_text("name: live\nfilters:\n  all:\n    keep: true\n")
    router = Router(load_policy_set(tmp_path / "plain.yaml"), latency=LatencyModels())
    decision = router.decide(request(stream=True), pods())
    record = DecisionTelemetry(tracer=spans.tracer).start(request(stream=True), decision, {}, 0.0)
    record.after_reply(None)
    record.end(STREAMED)
    attributes = dict(spans.only().attributes or {})
    assert not {a.PREDICTED_TTFT, a.PREDICTED_TPOT, a.SLO_TTFT, a.SLO_TTFT_MET} & set(attributes)
    assert a.TIME_PER_OUTPUT_TOKEN in attributes
