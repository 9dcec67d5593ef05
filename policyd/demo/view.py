"""What the demo prints: a live table on a terminal, plain lines otherwise, a summary.

On a terminal the frame (pods, then the latest decisions) is redrawn in place
a few times a second, every line cut to the terminal's width so nothing
wraps. Piped into a file or a test, each request is one line when its answer
is complete, and the pods' load is a block of lines every few seconds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import statistics
import time
from collections import deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final, TextIO

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
    f"{'tokens':>7}{'pfx':>6}  why (filter node pods in→kept · pick)"
)


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:.0f}ms"


def decision_line(record: DecisionRecord) -> str:
    """One request; TTFT only for streams (a JSON answer's first byte is its last).

    ``pfx`` is the chosen pod's prefix match (the share of the prompt policyd
    expects in its prefix cache), blank under a policy that does not read it.
    """
    status = "…" if record.status is None else str(record.status)
    if record.done and not record.completed:
        status = "cut"
    ttft = _ms(record.first_body_seconds) if record.stream else ""
    tokens = "" if record.completion_tokens is None else str(record.completion_tokens)
    model = short_model(record.model) + ("~" if record.stream else "")
    prefix = "" if record.prefix_match is None else f"{record.prefix_match:.2f}"
    return (
        f"{record.label:<6}{model[:14]:<15}{CRITICALITY.get(record.criticality, '?'):<5}"
        f"{record.pod or '-':<9}{status:>6}{ttft:>8}{_ms(record.duration_seconds):>8}"
        f"{tokens:>7}{prefix:>6}  {record.why}"
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

    async def follow(
        self, sending: Coroutine[Any, Any, None], traffic: TrafficResults, planned: int | None
    ) -> None:
        """Await ``sending``, showing on a terminal how many requests went and came back."""
        task = asyncio.ensure_future(sending)
        while not task.done():
            if self.live:
                self.out.write(f"\r  sent {traffic.sent} of {planned}, {traffic.finished} answered")
                self.out.flush()
            await asyncio.wait({task}, timeout=0.25)
        if self.live:
            self.out.write("\n")
        await task

    def _print_new(self, feed: DecisionFeed) -> None:
        new = feed.totals.finished - self._printed
        if new > 0:
            self._write([decision_line(record) for record in list(feed.done)[-new:]])
            self._printed = feed.totals.finished

    def _write(self, lines: Sequence[str]) -> None:
        for line in lines:
            self.out.write(line + "\n")


@dataclass(frozen=True, slots=True)
class RunFigures:
    """What one run under one policy achieved, for the side-by-side."""

    policy: str
    completed: int  # as the clients saw them: answered 200 and read to the end
    ttft_p50_s: float | None  # of the streams
    ttft_p90_s: float | None
    hit_rate: float | None  # cached prompt tokens / prompt tokens, as the pods reported
    adapter_pods: float | None  # distinct pods per adapter
    busiest_over_mean: float | None  # the most requests a pod got / the mean per pod


def run_figures(
    policy: str,
    feed: DecisionFeed,
    traffic: TrafficResults,
    pod_names: Sequence[str],
    adapters: Sequence[str],
) -> RunFigures:
    totals = feed.totals
    ttfts = sorted(totals.stream_ttft_seconds)
    routed = [totals.by_pod.get(name, 0) for name in pod_names]
    mean = sum(routed) / len(routed) if routed else 0.0
    return RunFigures(
        policy=policy,
        completed=traffic.completed,
        ttft_p50_s=statistics.median(ttfts) if ttfts else None,
        ttft_p90_s=ttfts[math.ceil(0.9 * len(ttfts)) - 1] if ttfts else None,
        hit_rate=totals.cached_tokens / totals.prompt_tokens if totals.prompt_tokens else None,
        adapter_pods=adapter_spread(feed, adapters),
        busiest_over_mean=max(routed) / mean if mean else None,
    )


def summary(
    feed: DecisionFeed,
    traffic: TrafficResults,
    *,
    seconds: float,
    pod_names: Sequence[str],
) -> list[str]:
    """What the run did: answers, requests per pod, tokens."""
    totals = feed.totals
    answers = "  ".join(f"{status} x{count}" for status, count in sorted(traffic.statuses.items()))
    failures = "  ".join(f"{why} x{count}" for why, count in sorted(traffic.failures.items()))
    lines = [
        f"summary: {traffic.finished} requests in {seconds:.1f} s through Envoy -> policyd -> "
        f"{len(pod_names)} simulated vLLM pods",
        f"  answers   {answers or 'none'}" + (f"   no answer: {failures}" if failures else ""),
        "  per pod   " + "  ".join(f"{name} {totals.by_pod.get(name, 0)}" for name in pod_names),
        f"  tokens    {totals.completion_tokens} generated, {totals.prompt_tokens} prompt tokens "
        f"of which {totals.cached_tokens} came from the pods' prefix caches (usage reported "
        "to policyd)",
    ]
    if totals.rejected:
        rejected = "  ".join(f"{code} x{n}" for code, n in sorted(totals.rejected.items()))
        lines.append(f"  rejected  {rejected} (answered before any decision)")
    return lines


_LABEL_WIDTH: Final = 24
_COLUMN_WIDTH: Final = 14


def comparison(runs: Sequence[RunFigures], *, time_scale: float) -> list[str]:
    """The runs' figures side by side; with two, how the first compares with the second."""
    rows: list[tuple[str, list[float | None], str]] = [
        ("completed", [run.completed for run in runs], "{:.0f}"),
        ("TTFT p50 (streams)", [_in_ms(run.ttft_p50_s) for run in runs], "{:.0f} ms"),
        ("TTFT p90 (streams)", [_in_ms(run.ttft_p90_s) for run in runs], "{:.0f} ms"),
        ("prefix-cache hit rate", [_in_percent(run.hit_rate) for run in runs], "{:.0f}%"),
        ("pods per adapter", [run.adapter_pods for run in runs], "{:.1f}"),
        ("busiest pod / mean", [run.busiest_over_mean for run in runs], "{:.2f}"),
    ]
    lines = [" " * (2 + _LABEL_WIDTH) + "".join(f"{run.policy:>{_COLUMN_WIDTH}}" for run in runs)]
    for label, values, shape in rows:
        cells = "".join(
            f"{'-' if value is None else shape.format(value):>{_COLUMN_WIDTH}}" for value in values
        )
        ratio = f"   {compare(values[0], values[1])}" if len(values) == 2 else ""
        lines.append(f"  {label:<{_LABEL_WIDTH}}{cells}{ratio}".rstrip())
    lines.append(
        f"  (TTFT on the wall clock, the pods running {time_scale:g}x faster than real time; "
        "hit rate: cached prompt tokens / prompt tokens)"
    )
    return lines


def compare(value: float | None, baseline: float | None) -> str:
    """``value`` against ``baseline`` in words: "same", "2.6x lower", "3.1x higher"."""
    if value is None or baseline is None:
        return ""
    if value == baseline or (baseline and abs(value / baseline - 1) < 0.05):
        return "same"
    if value == 0 or baseline == 0:
        return "lower" if value < baseline else "higher"
    ratio = value / baseline
    return f"{ratio:.1f}x higher" if ratio > 1 else f"{1 / ratio:.1f}x lower"


def _in_ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _in_percent(share: float | None) -> float | None:
    return None if share is None else share * 100


def adapter_spread(feed: DecisionFeed, adapters: Sequence[str]) -> float | None:
    """Distinct pods per adapter, averaged over the adapters that got at least two requests."""
    per_adapter: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for (model, pod), count in feed.totals.by_model_pod.items():
        if model in adapters:
            per_adapter.setdefault(model, set()).add(pod)
            counts[model] = counts.get(model, 0) + count
    measured = [model for model, n in counts.items() if n >= 2]
    if not measured:
        return None
    return sum(len(per_adapter[m]) for m in measured) / len(measured)
