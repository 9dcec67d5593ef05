"""The decision log: what a line holds, sampling, writing off the event loop, overflow."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from telemetry_support import Spans, one_request

from policyd.telemetry import DecisionLog, DecisionTelemetry

CARRIER = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_line_holds_the_inputs_the_walk_the_pick_and_the_response(
    tmp_path: Path, spans: Spans
) -> None:
    out = io.StringIO()
    log = DecisionLog(out)
    telemetry = DecisionTelemetry(tracer=spans.tracer, decision_log=log)
    one_request(telemetry, tmp_path, CARRIER)
    log.close()
    (entry,) = lines(out)
    span = spans.only()
    assert span.context is not None
    assert entry["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert entry["span_id"] == f"{span.context.span_id:016x}"
    assert entry["request_id"] == "req-1"
    assert entry["policy"] == "live" and len(entry["policy_version"]) == 12
    assert entry["request"] == {
        "model": "llama",
        "target_model": "llama",
        "criticality": "standard",
        "path": "/v1/chat/completions",
        "stream": False,
        "prompt_tokens": 12,
        "max_tokens": 64,
    }
    assert entry["candidates"] == 3 and entry["pods_omitted"] == 0
    assert entry["pods"][0] == {
        "name": "a",
        "address": "10.0.0.1:8000",
        "role": "both",
        "waiting_queue": 5,
        "running": 0,
        "kv_cache": 0.1,
        "in_flight": 0,
        "queued_prefill_tokens": 0,
        "max_loras": 0,
        "active_loras": [],
        "waiting_loras": [],
        "num_preemptions": 0,
        "base_model": "",
        "metrics_age_seconds": 0.0,
    }
    assert entry["walk"][0] == {
        "node": "short queue",
        "kind": "keep",
        "in": 3,
        "kept": ["a", "b"],
        "errors": [],
        "branch": "on_success",
        "next": "",
        "note": "",
    }
    assert entry["walk"][1]["kind"] == "score"
    assert entry["survivors"] == ["a", "b"]
    assert entry["scores"] == [{"pod": "a", "score": 0.9}, {"pod": "b", "score": 0.4}]
    assert (entry["outcome"], entry["status"], entry["pod"]) == ("routed", 200, "a")
    assert entry["endpoint"] == "10.0.0.1:8000"
    assert entry["fallbacks"] == ["10.0.0.2:8000"]
    assert entry["decision_seconds"] == 0.0003
    assert entry["shadows"] == [
        {
            "policy": "fewest-waiting",
            "policy_version": entry["shadows"][0]["policy_version"],
            "outcome": "routed",
            "pod": "b",
            "agreement": "other-pod",
        }
    ]
    assert entry["response"] == {
        "status": 200,
        "completed": True,
        "time_to_headers_seconds": 0.02,
        "time_to_first_token_seconds": 0.1,
        "duration_seconds": 0.9,
        "prompt_tokens": 12,
        "completion_tokens": 30,
        "cached_tokens": 8,
    }
    assert entry["time"].endswith("+00:00")


def test_without_tracing_the_trace_id_is_the_one_the_request_came_with(tmp_path: Path) -> None:
    out = io.StringIO()
    log = DecisionLog(out)
    one_request(DecisionTelemetry(decision_log=log), tmp_path, CARRIER)
    one_request(DecisionTelemetry(decision_log=log), tmp_path, {})
    log.close()
    first, second = lines(out)
    assert (first["trace_id"], first["span_id"]) == ("4bf92f3577b34da6a3ce929d0e0e4736", "")
    assert (second["trace_id"], second["span_id"]) == ("", "")


def test_sampling_keeps_the_requested_share(tmp_path: Path) -> None:
    draws = iter([0.05, 0.5, 0.09, 0.99])
    out = io.StringIO()
    log = DecisionLog(out, sample_rate=0.1, draw=lambda: next(draws))
    telemetry = DecisionTelemetry(decision_log=log)
    for _ in range(4):
        one_request(telemetry, tmp_path, {})
    log.close()
    assert len(lines(out)) == 2
    with pytest.raises(ValueError, match=r"sample rate must be in \[0, 1\]"):
        DecisionLog(io.StringIO(), sample_rate=1.5)
    never = DecisionLog(io.StringIO(), sample_rate=0.0)
    assert not any(never.sampled() for _ in range(100))
    never.close()


class RecordingOut(io.StringIO):
    """Remembers which thread wrote; can hold the writer back, says when it is held."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.held = threading.Event()

    def write(self, text: str) -> int:
        self.held.set()
        self.gate.wait(10)
        self.threads.add(threading.current_thread().name)
        return super().write(text)


def test_lines_are_written_by_the_writer_thread_and_overflow_is_dropped(tmp_path: Path) -> None:
    out = RecordingOut()
    log = DecisionLog(out, queue_limit=2)
    log.write({"first": True})
    assert out.held.wait(10)  # the writer is stuck on a slow disk
    telemetry = DecisionTelemetry(decision_log=log)
    for _ in range(6):
        one_request(telemetry, tmp_path, {})  # returns although nothing can be written
    assert log.dropped == 4  # 2 queued, the rest dropped
    out.gate.set()
    log.close()
    assert out.threads == {"policyd-decision-log"}
    assert len(lines(out)) == 3 == log.written


def test_a_file_log_is_appended_to_and_a_bad_path_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    path.write_text('{"earlier": true}\n')
    log = DecisionLog.open(str(path))
    one_request(DecisionTelemetry(decision_log=log), tmp_path, {})
    log.close()
    first, second = path.read_text().splitlines()
    assert json.loads(first) == {"earlier": True}
    assert json.loads(second)["outcome"] == "routed"
    with pytest.raises(ValueError, match="cannot open the decision log"):
        DecisionLog.open(str(tmp_path / "missing" / "x.jsonl"))


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "the writer thread did not get there"
        time.sleep(0.005)


def test_a_file_log_moved_away_by_log_rotation_is_reopened_at_its_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog.open(str(path), reopen_check_seconds=0.0)
    log.write({"n": 1})
    wait_for(lambda: log.written == 1)
    path.rename(tmp_path / "decisions.jsonl.1")  # logrotate's default: move, then a new file
    with caplog.at_level("INFO", logger="policyd.telemetry.decision_log"):
        log.write({"n": 2})
        wait_for(lambda: log.written == 2)
        path.unlink()  # removed outright
        log.write({"n": 3})
        log.close()
    assert (tmp_path / "decisions.jsonl.1").read_text() == '{"n":1}\n'
    assert path.read_text() == '{"n":3}\n'
    assert log.written == 3 and log.dropped == 0
    assert caplog.text.count("was moved or removed: writing to a new file there") == 2


def test_a_file_log_left_in_place_is_not_reopened(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog.open(str(path), reopen_check_seconds=0.0)
    log.write({"n": 1})
    wait_for(lambda: log.written == 1)
    opened = log._out
    log.write({"n": 2})
    wait_for(lambda: log.written == 2)
    assert log._out is opened
    log.close()
    assert path.read_text() == '{"n":1}\n{"n":2}\n'
