"""Text a client chooses is cut on spans, in the decision log and never becomes a label.

policyd refuses model names over 1 KiB, paths over 2 KiB and header blocks
over 64 KiB before routing (``tests/extproc/test_limits.py``); telemetry still
cuts every such text to ``MAX_TEXT`` characters with a marker, so what a span
or a log line holds, and what its caches keep, stays small whatever reaches it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from prometheus_client import generate_latest
from telemetry_support import Spans, one_request, request

from policyd.telemetry import DecisionLog, DecisionMetrics, DecisionTelemetry
from policyd.telemetry import attributes as a

CARRIER = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
HUGE = 200_000


def test_clip_keeps_short_text_and_marks_a_cut_with_the_length() -> None:
    assert a.clip("llama") == "llama"
    assert a.clip("x" * a.MAX_TEXT) == "x" * a.MAX_TEXT
    cut = a.clip("x" * HUGE)
    assert len(cut) == a.MAX_TEXT
    assert cut.endswith(f"...[{HUGE} chars]")
    assert a.clip("abcdef", 4) == "abcd"  # no room for the marker: never over the limit


def test_span_names_of_long_text_are_cut_and_not_cached() -> None:
    before = a._cached_decision_span_name.cache_info().currsize
    name = a.decision_span_name("/v1/chat/completions", "m" * HUGE)
    assert name.startswith("chat m") and len(name) <= len("chat ") + a.MAX_TEXT
    assert a.decision_span_name("/v1/" + "p" * HUGE + "/completions", "m") == "text_completion m"
    assert a._cached_decision_span_name.cache_info().currsize == before


def test_a_request_of_long_texts_is_cut_on_its_span_and_log_line_and_is_no_label(
    tmp_path: Path, spans: Spans
) -> None:
    out = io.StringIO()
    log = DecisionLog(out)
    metrics = DecisionMetrics()
    telemetry = DecisionTelemetry(tracer=spans.tracer, decision_log=log, metrics=metrics)
    asked = request(model="m" * HUGE, id="i" * HUGE, path="/v1/" + "p" * HUGE + "/chat/completions")
    one_request(telemetry, tmp_path, CARRIER, asked)
    log.close()

    span = spans.only()
    assert len(span.name) <= 300
    attributes = dict(span.attributes or {})
    for key in (a.GEN_AI_REQUEST_MODEL, a.TARGET_MODEL, a.REQUEST_ID):
        value = attributes[key]
        assert isinstance(value, str)
        assert len(value) == a.MAX_TEXT and value.endswith(f"...[{HUGE} chars]"), key

    (line,) = out.getvalue().splitlines()
    assert len(line) < 8192
    entry = json.loads(line)
    assert entry["request_id"].endswith(f"...[{HUGE} chars]")
    assert len(entry["request"]["model"]) == a.MAX_TEXT
    assert len(entry["request"]["target_model"]) == a.MAX_TEXT
    assert len(entry["request"]["path"]) == a.MAX_TEXT

    exposition = generate_latest(metrics.registry).decode()
    assert "mmmmmmmm" not in exposition and "iiiiiiii" not in exposition
    assert max(len(line) for line in exposition.splitlines()) < 1024
