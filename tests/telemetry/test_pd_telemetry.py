"""What a two-stage (prefill/decode) decision records: the span's split attributes,
the decision log's split entry, the split counter and each role's load."""

from __future__ import annotations

import io
import json
import random
import textwrap
from pathlib import Path

from telemetry_support import Spans
from test_metrics import FakePool, Snapshot, Stats

from policyd.policy import PolicyStore, Request, Router
from policyd.pool.inflight import InFlight
from policyd.pool.pod import Pod
from policyd.telemetry import DecisionTelemetry
from policyd.telemetry import attributes as a
from policyd.telemetry.decision_log import DecisionLog
from policyd.telemetry.exchange_end import ExchangeEnd
from policyd.telemetry.metrics import DecisionMetrics
from policyd.telemetry.pool_metrics import PoolCollector

PD = """
name: pd
prefill:
  when: request.prompt_tokens >= 1000
  filters:
    has room:
      keep: pod.waiting_queue < 5
"""
DECODE = Pod("decode-a", "10.0.0.1:8000", role="decode")
PREFILL = Pod("prefill-a", "10.0.0.2:8000", role="prefill", waiting_queue=1)
FULL = Pod("prefill-b", "10.0.0.3:8000", role="prefill", waiting_queue=9)
LONG = Request(model="m", id="long", prompt_tokens=4000)
SHORT = Request(model="m", id="short", prompt_tokens=40)


def router(tmp_path: Path) -> Router:
    (tmp_path / "pd.yaml").write_text(textwrap.dedent(PD).lstrip())
    return Router(PolicyStore.open(tmp_path / "pd.yaml"), rng=random.Random(0))


def end(record: object) -> None:
    figures = ExchangeEnd(
        completed=True,
        duration_seconds=0.5,
        first_body_seconds=0.1,
        prompt_tokens=40,
        completion_tokens=8,
    )
    record.end(figures)  # type: ignore[attr-defined]


def test_the_span_names_both_pods_the_split_and_why(tmp_path: Path, spans: Spans) -> None:
    decide = router(tmp_path)
    telemetry = DecisionTelemetry(tracer=spans.tracer)
    for request in (LONG, SHORT):
        record = telemetry.start(request, decide.decide(request, [DECODE, PREFILL, FULL]), {}, 0)
        record.after_reply()
        end(record)
    long, short = (dict(span.attributes or {}) for span in spans.finished())
    assert long[a.POD] == "decode-a"  # the decode pod is the request's pod
    assert (long[a.PD_SPLIT], long[a.PD_REASON]) == (True, "when-true")
    assert (long[a.PD_PREFILL_POD], long[a.PD_PREFILL_ENDPOINT]) == ("prefill-a", PREFILL.address)
    assert long[a.PD_PREFILL_WALK] == "has room (keep) 2\u21921 on_success"
    assert (short[a.PD_SPLIT], short[a.PD_REASON]) == (False, "when-false")
    assert a.PD_PREFILL_POD not in short and a.PD_PREFILL_WALK not in short


def test_a_single_stage_policys_span_has_no_split_attributes(tmp_path: Path, spans: Spans) -> None:
    (tmp_path / "one.yaml").write_text("name: one\n")
    decision = Router(PolicyStore.open(tmp_path / "one.yaml")).decide(LONG, [DECODE])
    record = DecisionTelemetry(tracer=spans.tracer).start(LONG, decision, {}, 0)
    record.after_reply()
    end(record)
    attributes = dict(spans.only().attributes or {})
    assert not [name for name in attributes if name.startswith("policyd.pd.")]


def test_the_decision_log_says_why_a_request_was_not_split(tmp_path: Path) -> None:
    out = io.StringIO()
    log = DecisionLog(out)
    decision = router(tmp_path).decide(LONG, [DECODE, FULL])
    record = DecisionTelemetry(decision_log=log).start(LONG, decision, {}, 0)
    record.after_reply()
    end(record)
    log.close()
    (entry,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert entry["pod"] == "decode-a"
    split = entry["split"]
    assert (split["split"], split["reason"], split["pod"]) == (False, "no-prefill-pod", "")
    assert "has room" in split["note"] and split["walk"] == "has room (keep) 1\u21920 on_failure"


def test_the_split_rate_and_each_roles_load_are_metrics(tmp_path: Path) -> None:
    metrics = DecisionMetrics()
    decide = router(tmp_path)
    for request in (LONG, LONG, SHORT):
        metrics.decision(decide.decide(request, [DECODE, PREFILL]), 0.0)
    r = metrics.registry
    split = {"policy": "pd", "split": "true", "reason": "when-true"}
    not_split = {"policy": "pd", "split": "false", "reason": "when-false"}
    assert r.get_sample_value("policyd_pd_decisions_total", split) == 2
    assert r.get_sample_value("policyd_pd_decisions_total", not_split) == 1
    decode = Pod("decode-a", "10.0.0.1:8000", role="decode", running=3, load=InFlight(2))
    prefill = Pod("prefill-a", "10.0.0.2:8000", role="prefill", waiting_queue=4, load=InFlight(1))
    other = Pod("prefill-b", "10.0.0.3:8000", role="prefill", load=InFlight(1))
    stats = {pod.address: Stats(1, 0, 0, 0.01, 1.0) for pod in (decode, prefill, other)}
    metrics.registry.register(
        PoolCollector(FakePool(Snapshot((decode, prefill, other), (decode, prefill)), stats))
    )
    by_role = {
        role: {
            name: r.get_sample_value(f"policyd_role_{name}", {"role": role})
            for name in ("pods", "candidate_pods", "in_flight_requests", "running_requests",
                         "waiting_requests")
        }
        for role in ("decode", "prefill")
    }  # fmt: skip
    assert by_role["decode"] == {
        "pods": 1, "candidate_pods": 1, "in_flight_requests": 2, "running_requests": 3,
        "waiting_requests": 0,
    }  # fmt: skip
    assert by_role["prefill"] == {
        "pods": 2, "candidate_pods": 1, "in_flight_requests": 2, "running_requests": 0,
        "waiting_requests": 4,
    }  # fmt: skip
