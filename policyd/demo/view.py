"""What the demo prints: a live table on a terminal, plain lines otherwise, a summary.

On a terminal the frame (pods, then the latest decisions) is redrawn in place
a few times a second, every line cut to the terminal's width so nothing
wraps. Piped into a file or a test, each request is one line when its answer
is complete, and the pods' load is a block of lines every few seconds.
"""

from __future__ import annotations

import logging
import math
import shutil
import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import Final, TextIO

from policyd.demo.feed import DecisionFeed, DecisionRecord
from policyd.demo.traffic import TrafficResults
from policyd.pool.pod import Pod

CRITICALITY: Final = {"critical": "crit", "standard": "std", "sheddable": "shed"}
PLAIN_LOAD_EVERY_S: Final = 3.0
_CLEAR_DOWN: Final = "\x1b[J"
_HIDE_CURSOR: Final = "\x1b[?25l"
_SHOW_CURSOR: Final = "\x1b[?25h"


def short_model(model: str) -> str:
    return model.rsplit("/", 1)[-1]


def pod_lines(pods: Sequence[Pod], candidates: set[str], routed: dict[str, int]) -> list[str]:
    lines = [
        f"{'pod':<9}{'address':<18}{'ready':<6}{'queue':>6}{'run':>5}{'KV':>6}"
        f"{'in-flight':>10}{'routed':>8}  active adapters (waiting)"
    ]
    for pod in pods:
        adapters = ",".join(pod.active_loras) or "-"
        if pod.waiting_loras:
            adapters += f" ({','.join(pod.waiting_loras)})"
        lines.append(
            f"{pod.name:<9}{pod.address:<18}{'yes' if pod.name in candidates else 'no':<6}"
            f"{pod.waiting_queue:>6}{pod.running:>5}{pod.kv_cache:>6.0%}"
            f"{pod.in_flight:>10}{routed.get(pod.name, 0):>8}  {adapters}"
        )
    return lines


DECISION_HEADER: Final = (
    f"{'req':<6}{'model':<15}{'crit':<5}{'pod':<9}{'status':>6}{'TTFT':>8}{'time':>8}"
    f"{'tokens':>7}  why (filter node pods in→kept · pick)"
)


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:.0f}ms"


def decision_line(record: DecisionRecord) -> str:
    """One request; TTFT only for streams (a JSON answer's first byte is its last)."""
    status = "…" if record.status is None else str(record.status)
    if record.done and not record.completed:
        status = "cut"
    ttft = _ms(record.first_body_seconds) if record.stream else ""
    tokens = "" if record.completion_tokens is None else str(record.completion_tokens)
    model = short_model(record.model) + ("~" if record.stream else "")
    return (
        f"{record.label:<6}{model[:14]:<15}{CRITICALITY.get(record.criticality, '?'):<5}"
        f"{record.pod or '-':<9}{status:>6}{ttft:>8}{_ms(record.duration_seconds):>8}"
        f"{tokens:>7}  {record.why}"
    )


class LogLines(logging.Handler):
    """Keeps warnings for the live frame's footer (printing them would tear the frame)."""

    def __init__(self, keep: int = 2) -> None:
        super().__init__(logging.WARNING)
        self.lines: deque[str] = deque(maxlen=keep)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(" ".join(self.format(record).split()))


class View:
    """Draws the demo; ``live`` redraws in place (a terminal), else prints lines."""

    def __init__(self, out: TextIO, *, live: bool) -> None:
        self.out = out
        self.live = live
        self.log = LogLines()
        self._drawn = 0
        self._printed = 0  # finished requests already printed (plain mode)
        self._load_printed_at = 0.0

    def start(self, title: Sequence[str]) -> None:
        self._write(list(title))
        if self.live:
            self.out.write(_HIDE_CURSOR)
        self.out.flush()

    def close(self) -> None:
        if self.live:
            self.out.write(_SHOW_CURSOR)
            self.out.flush()

    def update(
        self,
        feed: DecisionFeed,
        pods: Sequence[Pod],
        candidates: set[str],
        traffic: TrafficResults,
        planned: int | None,
    ) -> None:
        routed = dict(feed.totals.by_pod)
        if not self.live:
            self._print_new(feed)
            now = time.monotonic()
            if now - self._load_printed_at >= PLAIN_LOAD_EVERY_S:
                self._load_printed_at = now
                self._write(["", *pod_lines(pods, candidates, routed), "", DECISION_HEADER])
            self.out.flush()
            return
        width, height = shutil.get_terminal_size((120, 40))
        pods_block = pod_lines(pods, candidates, routed)
        rows = max(4, min(30, height - len(pods_block) - 8))
        recent = list(feed.records)[-rows:]
        goal = "until Ctrl-C" if planned is None else f"of {planned}"
        answers = "  ".join(f"{s}: {n}" for s, n in sorted(traffic.statuses.items()))
        frame = [
            *pods_block,
            "",
            DECISION_HEADER,
            *(decision_line(record) for record in recent),
            "",
            f"sent {traffic.sent} {goal}, {traffic.in_flight} in flight   {answers}   "
            "(~ streamed; Ctrl-C stops)",
            *self.log.lines,
        ]
        lines = [line[: width - 1] for line in frame]
        up = f"\x1b[{self._drawn}F" if self._drawn else ""
        self.out.write(up + _CLEAR_DOWN + "\n".join(lines) + "\n")
        self.out.flush()
        self._drawn = len(lines)

    def _print_new(self, feed: DecisionFeed) -> None:
        new = feed.totals.finished - self._printed
        if new > 0:
            self._write([decision_line(record) for record in list(feed.done)[-new:]])
            self._printed = feed.totals.finished

    def _write(self, lines: Sequence[str]) -> None:
        for line in lines:
            self.out.write(line + "\n")


def summary(
    feed: DecisionFeed,
    traffic: TrafficResults,
    *,
    seconds: float,
    pod_names: Sequence[str],
    time_scale: float,
    adapters: Sequence[str],
) -> list[str]:
    totals = feed.totals
    answers = "  ".join(f"{status} x{count}" for status, count in sorted(traffic.statuses.items()))
    failures = "  ".join(f"{why} x{count}" for why, count in sorted(traffic.failures.items()))
    lines = [
        f"summary: {traffic.finished} requests in {seconds:.1f} s through Envoy -> policyd -> "
        f"{len(pod_names)} simulated vLLM pods",
        f"  answers   {answers or 'none'}" + (f"   no answer: {failures}" if failures else ""),
        "  per pod   " + "  ".join(f"{name} {totals.by_pod.get(name, 0)}" for name in pod_names),
    ]
    spread = adapter_spread(feed, adapters, len(pod_names))
    if spread is not None:
        observed, uniform = spread
        lines.append(
            f"  affinity  requests for one adapter went to {observed:.1f} pods on average; "
            f"spread uniformly at random they would reach {uniform:.1f}"
        )
    ttfts = sorted(totals.stream_ttft_seconds)
    if ttfts:
        p50 = statistics.median(ttfts) * 1000
        p90 = ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)] * 1000
        lines.append(
            f"  TTFT      streams: p50 {p50:.0f} ms, p90 {p90:.0f} ms on the wall clock "
            f"(the pods run {time_scale:g}x faster than real time)"
        )
    lines.append(f"  tokens    {totals.completion_tokens} generated (usage reported to policyd)")
    if totals.rejected:
        rejected = "  ".join(f"{code} x{n}" for code, n in sorted(totals.rejected.items()))
        lines.append(f"  rejected  {rejected} (answered before any decision)")
    return lines


def adapter_spread(
    feed: DecisionFeed, adapters: Sequence[str], pods: int
) -> tuple[float, float] | None:
    """Average distinct pods per adapter, and what uniform random routing would give.

    For ``n`` requests spread uniformly over ``k`` pods the expected number of
    distinct pods is ``k * (1 - (1 - 1/k) ** n)``; both averages are over
    the adapters that got at least two requests.
    """
    per_adapter: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for (model, pod), count in feed.totals.by_model_pod.items():
        if model in adapters:
            per_adapter.setdefault(model, set()).add(pod)
            counts[model] = counts.get(model, 0) + count
    measured = [model for model, n in counts.items() if n >= 2]
    if not measured or pods < 2:
        return None
    observed = sum(len(per_adapter[m]) for m in measured) / len(measured)
    uniform = sum(pods * (1 - (1 - 1 / pods) ** counts[m]) for m in measured) / len(measured)
    return observed, uniform
