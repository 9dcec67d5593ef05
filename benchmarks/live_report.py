"""The live benchmark's figures: one cell's from its outcomes, the median over repeats, tables.

Pure functions over plain data (no processes, no clock), so the tests check
them directly. Every time is in simulated seconds: wall seconds times the
cell's time scale.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from flow_quality import GOAL_CRITICAL_P99, GOAL_GOODPUT, GOAL_IDLE_P90, GOAL_THROUGHPUT
from live_stack import Outcome, PoolCounters
from reporting import verdict as _verdict

from policyd.sim.blocks import prefix_keys
from policyd.sim.experiment import percentile

RANDOM: Final = "random"
BALANCED: Final = "lora-balanced"  # the best load-aware shipped policy without locality
NO_FLOW: Final = "none"
SMALL_TENANT: Final = "tenant-b"
CRITICAL: Final = "critical"
AGREEMENT: Final = 0.05  # live and virtual within 5%


def ceiling(prompts: Iterable[tuple[str, Sequence[int]]], block_size: int) -> float:
    """The best hit rate any router could reach on these prompts (model, token ids).

    A prompt's full block can be a hit only if another request computed the
    same block first (same model, same tokens up to and through it: the
    chained key), so each key's first occurrence is a miss and the hits are at
    most ``block_size`` tokens per later occurrence: the share of prompt tokens
    in full blocks shared with another request, an upper bound whatever the
    order and the caches.
    """
    keys: Counter[int] = Counter()
    tokens = 0
    for model, prompt in prompts:
        keys.update(prefix_keys(model, tuple(prompt), block_size))
        tokens += len(prompt)
    shared = sum(count - 1 for count in keys.values())
    return shared * block_size / tokens if tokens else 0.0


@dataclass(frozen=True, slots=True)
class ClassFigures:
    offered: int
    completed: int
    answered: int  # 429/503 from policyd, with a reason
    ttft_p90: float
    ttft_p99: float

    @property
    def goodput(self) -> float:
        return self.completed / self.offered if self.offered else 1.0


@dataclass(frozen=True, slots=True)
class CellRun:
    """One cell's raw figures (a picker on a workload, at a load and a time scale, one repeat)."""

    workload: str
    load: str
    rate: float  # requests/s of simulated time (0 for the seed burst)
    time_scale: float
    picker: str
    repeat: int
    offered: int
    sent: int
    completed: int
    answered: int
    lost: int  # neither completed nor answered: the client gave up
    output_tokens: int
    duration_s: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    hit_rate: float
    ceiling: float
    busiest: float  # the busiest pod's routed requests over the mean
    window_per_s: float  # completed while requests arrived, per second: the pool's throughput
    # their output tokens per second, the virtual runs' tok/s (``tokens_per_s`` runs to
    # the last answer, so one request left waiting for its timeout stretches it)
    window_tokens_per_s: float
    classes: Mapping[str, ClassFigures] = field(default_factory=dict)
    answers: Mapping[str, int] = field(default_factory=dict)  # why requests were not served
    failed_scrapes: float = 0.0  # share of policyd's scrapes the pods did not answer in time
    peak_held: int = 0
    peak_rss_mib: float = 0.0
    wall_s: float = 0.0
    pod_finished: float = 0.0  # requests the pods finished, whether or not the client saw it
    pod_tokens: float = 0.0  # tokens the pods generated, for clients that gave up too
    slo: Mapping[str, float] = field(default_factory=dict)  # the SLO workload's figures
    pd: Mapping[str, float] = field(default_factory=dict)  # the RAG workload's P/D figures


def ttft_values(outcomes: Sequence[Outcome], scale: float, rule: str) -> list[float]:
    """TTFT of the streamed requests, simulated seconds, counted as the virtual runs count it.

    ``completed``: completed requests only (the seed experiment); ``sent``:
    every sent request, one without a first token as infinitely slow (the
    prefix-cache workloads); ``first``: requests that got a first token (flow
    control's workloads, time held at the gateway included).
    """
    values = []
    for o in outcomes:
        if not o.streamed or o.sent is None:
            continue
        if o.first is not None and (rule != "completed" or o.done is not None):
            values.append((o.first - o.sent) * scale)
        elif rule == "sent":
            values.append(math.inf)
    return values


def tail_percentile(values: Sequence[float], fraction: float) -> float:
    """The percentile; ``inf`` when it falls on or next to a request that never got a token."""
    if not values:
        return math.inf
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    low = math.floor(position)
    if math.isinf(ordered[min(low + 1, len(ordered) - 1)]) and position > low:
        return math.inf
    return percentile(ordered, fraction)


def class_figures(outcomes: Sequence[Outcome], scale: float) -> dict[str, ClassFigures]:
    groups: dict[str, list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault(o.group, []).append(o)
    found = {}
    for name, mine in sorted(groups.items()):
        ttft = ttft_values(mine, scale, "first")
        found[name] = ClassFigures(
            offered=len(mine),
            completed=sum(1 for o in mine if o.done is not None),
            answered=sum(1 for o in mine if _answered(o)),
            ttft_p90=tail_percentile(ttft, 0.9),
            ttft_p99=tail_percentile(ttft, 0.99),
        )
    return found


def _answered(outcome: Outcome) -> bool:
    return outcome.answer is not None and not outcome.answer.startswith("client")


def busiest(routed: Mapping[str, float], pods: int) -> float:
    """The busiest pod's routed requests over the mean across ``pods`` pods (1.0: even)."""
    total = sum(routed.values())
    return max(routed.values()) / (total / pods) if total else 1.0


def cell_run(
    *,
    key: tuple[str, str, float, float, str, int],
    outcomes: Sequence[Outcome],
    ended_s: float,
    window_s: float,
    counters: PoolCounters,
    ceiling_rate: float,
    rule: str,
    pods: int,
    flow: bool,
    wall_s: float,
) -> CellRun:
    """A cell's figures from its outcomes (wall seconds) and its stack's counters.

    ``window_s`` is the arrival window in wall seconds (0 for the seed burst).
    """
    workload, load, rate, scale, picker, repeat = key
    ttft = ttft_values(outcomes, scale, rule)
    completed = [o for o in outcomes if o.done is not None]
    tokens = sum(o.tokens for o in completed)
    duration = ended_s * scale
    in_window = [o for o in completed if o.done is not None and o.done <= window_s]
    return CellRun(
        workload=workload,
        load=load,
        rate=rate,
        time_scale=scale,
        picker=picker,
        repeat=repeat,
        offered=len(outcomes),
        sent=sum(1 for o in outcomes if o.sent is not None),
        completed=len(completed),
        answered=sum(1 for o in outcomes if _answered(o)),
        lost=sum(1 for o in outcomes if o.sent is not None and o.done is None and not _answered(o)),
        output_tokens=tokens,
        duration_s=duration,
        tokens_per_s=tokens / duration if duration > 0 else 0.0,
        ttft_p50=tail_percentile(ttft, 0.5),
        ttft_p90=tail_percentile(ttft, 0.9),
        ttft_p99=tail_percentile(ttft, 0.99),
        hit_rate=counters.prefix_hits / counters.prefix_queries if counters.prefix_queries else 0,
        ceiling=ceiling_rate,
        busiest=busiest(counters.routed, pods),
        window_per_s=len(in_window) / (window_s * scale) if window_s > 0 else 0.0,
        window_tokens_per_s=sum(o.tokens for o in in_window) / (window_s * scale)
        if window_s > 0
        else 0.0,
        classes=class_figures(outcomes, scale) if flow else {},
        answers=dict(Counter(o.answer for o in outcomes if o.answer is not None)),
        failed_scrapes=counters.failed_scrapes / counters.scrapes if counters.scrapes else 0.0,
        peak_held=counters.peak_held,
        peak_rss_mib=counters.peak_rss_kb / 1024,
        wall_s=wall_s,
        pod_finished=counters.pod_finished,
        pod_tokens=counters.pod_tokens,
    )


# --- over repeats ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spread:
    """The median and the range of one figure over repeats."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            return cls(math.nan, math.nan, math.nan)
        return cls(statistics.median(values), min(values), max(values))

    def show(self, fmt: str) -> str:
        if math.isnan(self.median):
            return "-"
        text = format(self.median, fmt)
        if self.low == self.high:
            return text
        return f"{text} ({format(self.low, fmt)}-{format(self.high, fmt)})"


Group = tuple[str, str, float]  # workload, load, time scale


def grouped(runs: Iterable[CellRun]) -> dict[Group, dict[str, list[CellRun]]]:
    """Runs by (workload, load, time scale), then by picker, each list in repeat order."""
    found: dict[Group, dict[str, list[CellRun]]] = {}
    for run in runs:
        found.setdefault((run.workload, run.load, run.time_scale), {}).setdefault(
            run.picker, []
        ).append(run)
    for pickers in found.values():
        for runs_of in pickers.values():
            runs_of.sort(key=lambda r: r.repeat)
    return found


def paired(
    mine: Sequence[CellRun],
    reference: Sequence[CellRun] | None,
    figure: Callable[[CellRun], float],
    *,
    lower_better: bool = False,
) -> Spread:
    """``figure`` of ``mine`` over the reference's in the same repeat (the same run), per repeat.

    For a figure where lower is better the ratio is the reference's over
    mine: how many times lower.
    """
    if not reference:
        return Spread.of([])
    by_repeat = {r.repeat: figure(r) for r in reference}
    ratios = []
    for run in mine:
        base, value = by_repeat.get(run.repeat), figure(run)
        if base is None:
            continue
        top, bottom = (base, value) if lower_better else (value, base)
        if bottom > 0 and math.isfinite(top) and math.isfinite(bottom):
            ratios.append(top / bottom)
    return Spread.of(ratios)


def _gains(mine: Sequence[CellRun], reference: Sequence[CellRun] | None) -> str:
    if not reference:
        return "-"
    done = paired(mine, reference, lambda r: r.completed).show(".2f")
    tokens = paired(mine, reference, lambda r: r.tokens_per_s).show(".2f")
    p90 = paired(mine, reference, lambda r: r.ttft_p90, lower_better=True).show(".2f")
    return f"{done} / {tokens} / {p90}"


def _of(runs: Sequence[CellRun], figure: Callable[[CellRun], float], fmt: str) -> str:
    return Spread.of([figure(r) for r in runs]).show(fmt)


def _title(group: Group, runs: Sequence[CellRun]) -> str:
    workload, load, scale = group
    repeats = len({r.repeat for r in runs})
    return f"**{workload}, {load}, time scale {scale:g}** ({repeats} repeat(s); median (min-max))"


def table(group: Group, pickers: Mapping[str, Sequence[CellRun]]) -> list[str]:
    """One markdown table: a row per picker, gains paired per repeat against random and
    lora-balanced (completed / tok/s / TTFT p90 times lower)."""
    runs = [r for rs in pickers.values() for r in rs]
    rows = [
        _title(group, runs),
        "",
        "| picker | completed | output tok/s | TTFT p50 s | p90 s | p99 s | hit rate | of ceiling "
        "| busiest / mean | vs random: completed / tok/s / p90 lower | vs lora-balanced |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for picker, mine in sorted(pickers.items()):
        rows.append(
            f"| {picker} | {_of(mine, lambda r: r.completed, '.0f')}/{mine[0].offered} "
            f"| {_of(mine, lambda r: r.tokens_per_s, '.0f')} "
            f"| {_of(mine, lambda r: r.ttft_p50, '.2f')} "
            f"| {_of(mine, lambda r: r.ttft_p90, '.2f')} "
            f"| {_of(mine, lambda r: r.ttft_p99, '.2f')} "
            f"| {_of(mine, lambda r: r.hit_rate, '.1%')} "
            f"| {_of(mine, lambda r: r.hit_rate / r.ceiling if r.ceiling else 0.0, '.0%')} "
            f"| {_of(mine, lambda r: r.busiest, '.2f')} "
            f"| {_gains(mine, pickers.get(RANDOM))} | {_gains(mine, pickers.get(BALANCED))} |"
        )
    rows.append(
        f"(ceiling: {_of(runs, lambda r: r.ceiling, '.1%')} of the prompt tokens; {_scrapes(runs)})"
    )
    return rows


def _scrapes(runs: Sequence[CellRun]) -> str:
    """How far the machine kept up: the scrapes the pods did not answer in time."""
    return f"failed scrapes {_of(runs, lambda r: r.failed_scrapes, '.1%')}"


def flow_table(
    group: Group, pickers: Mapping[str, Sequence[CellRun]], idle: Sequence[CellRun]
) -> list[str]:
    """Flow control's table and issue 26's goals for each repeat, against the idle runs."""
    runs = [r for rs in pickers.values() for r in rs]
    rows = [
        _title(group, runs),
        "",
        "| contender | completed | req/s while arriving | vs none | answered | lost "
        "| small tenant goodput | its TTFT p90 vs idle | critical p99 vs idle | peak held "
        "| policyd peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    idle_by = {r.repeat: r for r in idle}
    for picker, mine in sorted(pickers.items()):
        rows.append(
            f"| {picker} | {_of(mine, lambda r: r.completed, '.0f')}/{mine[0].offered} "
            f"| {_of(mine, lambda r: r.window_per_s, '.2f')} "
            f"| {paired(mine, pickers.get(NO_FLOW), lambda r: r.window_per_s).show('.1%')} "
            f"| {_of(mine, lambda r: r.answered, '.0f')} | {_of(mine, lambda r: r.lost, '.0f')} "
            f"| {_class_of(mine, SMALL_TENANT, lambda c: c.goodput, '.1%')} "
            f"| {_vs_idle(mine, idle_by, SMALL_TENANT, lambda c: c.ttft_p90)} "
            f"| {_vs_idle(mine, idle_by, CRITICAL, lambda c: c.ttft_p99)} "
            f"| {_of(mine, lambda r: r.peak_held, '.0f')} "
            f"| {_of(mine, lambda r: r.peak_rss_mib, '.0f')} |"
        )
    rows.append(f"({_scrapes(runs)})")
    return rows


def _class_of(
    runs: Sequence[CellRun], name: str, figure: Callable[[ClassFigures], float], fmt: str
) -> str:
    values = [figure(r.classes[name]) for r in runs if name in r.classes]
    return Spread.of(values).show(fmt)


def _vs_idle(
    runs: Sequence[CellRun],
    idle: Mapping[int, CellRun],
    name: str,
    figure: Callable[[ClassFigures], float],
) -> str:
    ratios = []
    for run in runs:
        reference = idle.get(run.repeat)
        if reference is None or name not in run.classes or name not in reference.classes:
            continue
        base = figure(reference.classes[name])
        if base > 0 and math.isfinite(base):
            ratios.append(figure(run.classes[name]) / base)
    return Spread.of(ratios).show(".1f") + ("x" if ratios else "")


def flow_goals(
    group: Group, pickers: Mapping[str, Sequence[CellRun]], idle: Sequence[CellRun]
) -> list[str]:
    """Issue 26's goals per flow contender and repeat: met or MISSED, with the numbers."""
    workload, load, scale = group
    idle_by = {r.repeat: r for r in idle}
    none = {r.repeat: r for r in pickers.get(NO_FLOW, ())}
    lines = []
    for picker, mine in sorted(pickers.items()):
        if picker == NO_FLOW:
            continue
        for run in mine:
            verdicts = [f"nothing lost ({run.lost}): {_verdict(run.lost == 0)}"]
            base, reference = idle_by.get(run.repeat), none.get(run.repeat)
            small = run.classes.get(SMALL_TENANT)
            if small is not None:
                verdicts.append(
                    f"small tenant goodput {small.goodput:.1%}: "
                    f"{_verdict(small.goodput >= GOAL_GOODPUT)}"
                )
                if base is not None and SMALL_TENANT in base.classes:
                    ratio = small.ttft_p90 / base.classes[SMALL_TENANT].ttft_p90
                    verdicts.append(
                        f"its TTFT p90 {ratio:.1f}x idle: {_verdict(ratio <= GOAL_IDLE_P90)}"
                    )
                if reference is not None and reference.window_per_s > 0:
                    share = run.window_per_s / reference.window_per_s
                    verdicts.append(
                        f"throughput {share:.1%} of none's: {_verdict(share >= GOAL_THROUGHPUT)}"
                    )
            critical = run.classes.get(CRITICAL)
            if critical is not None and base is not None and CRITICAL in base.classes:
                ratio = critical.ttft_p99 / base.classes[CRITICAL].ttft_p99
                verdicts.append(
                    f"critical TTFT p99 {ratio:.1f}x idle: {_verdict(ratio <= GOAL_CRITICAL_P99)}"
                )
            lines.append(
                f"{workload} {load} x{scale:g} {picker} repeat {run.repeat}: " + "; ".join(verdicts)
            )
    return lines


# --- live against virtual -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Virtual:
    """The same cell in virtual time: the figures the agreement compares, and the tokens
    the pods generated (timed-out requests' included; ``nan`` where not counted)."""

    completed: float
    ttft_p90: float
    generated: float = math.nan


def agreement(
    runs: Iterable[CellRun], virtual: Mapping[tuple[str, str, str], Virtual]
) -> list[str]:
    """Live (median over repeats) against virtual time on the same seed, per cell: the ratios
    and whether both are within 5%.

    Two more columns tell a machine that could not keep up from a runner that models
    something else: the tokens the pods generated, live over virtual (below 1 when the
    pods' clock slipped behind the wall on a loaded machine), and the requests the pods
    finished that their client never saw complete (the answer arrived after it gave up:
    delivery through Envoy and policyd lagging the pods).
    """
    rows = [
        "| workload, load | time scale | picker | completed live / virtual | ratio "
        "| TTFT p90 s live / virtual | ratio | within 5% | pods' tokens live / virtual "
        "| finished at the pods, not at the client |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, load, scale), pickers in sorted(grouped(runs).items()):
        for picker, mine in sorted(pickers.items()):
            twin = virtual.get((workload, load, picker))
            if twin is None:
                continue
            done = statistics.median(r.completed for r in mine)
            p90 = statistics.median(r.ttft_p90 for r in mine)
            done_ratio = done / twin.completed if twin.completed else math.nan
            p90_ratio = p90 / twin.ttft_p90 if twin.ttft_p90 else math.nan
            met = all(abs(x - 1) <= AGREEMENT for x in (done_ratio, p90_ratio))
            tokens = statistics.median(r.pod_tokens for r in mine)
            tokens_ratio = tokens / twin.generated if twin.generated > 0 else math.nan
            unseen = statistics.median(max(r.pod_finished - r.completed, 0.0) for r in mine)
            rows.append(
                f"| {workload}, {load} | {scale:g} | {picker} | {done:.0f} / {twin.completed:.0f} "
                f"| {done_ratio:.3f} | {p90:.2f} / {twin.ttft_p90:.2f} | {p90_ratio:.3f} "
                f"| {'yes' if met else 'NO'} | {tokens_ratio:.3f} | {unseen:.0f} |"
            )
    return rows
