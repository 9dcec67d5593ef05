"""Disaggregated prefill/decode against aggregated serving, in virtual time (issue 36).

    python benchmarks/pd_quality.py --seeds 5 --first-seed 100        # tuning seeds
    python benchmarks/pd_quality.py --seeds 3 --first-seed 300        # held-out seeds

The workload is ``policyd.sim.workloads.RagMix``: long-context RAG questions
(a shared document of 2,000-8,000 tokens and a question; 100-300 output
tokens) and short chat, half and half, streamed, arriving open loop
(Poisson) on 6 pods of the V1 profile ``l4-llama3.1-8b``. The workload sets
each answer's length (the profile's own draw from ``max_tokens`` is off:
the issue states the output lengths). Each request goes through the
serving path's own parser and ``Router.decide`` on the simulator's virtual
clock (``flow_quality.FlowRun``); a split decision sends the prompt to the
prefill pod the policy named (``remote_decode``) and the decode to the
chosen pod, which waits for the KV transfer (``policyd.sim.open_loop.Split``).
The approximate prefix index learns both pods of a split, as ``policyd serve``
does.

Contenders, on the same requests and the same 6 pods:

- aggregated: every pod ``both``, routed by ``rules/lora-prefix.yaml`` and by
  ``rules/prefix-aware.yaml``; the better of the two (lower ITL p90 at the
  goal's load) is the baseline;
- P/D: ``PREFILL_PODS`` pods ``prefill``, the rest ``decode``, routed by
  ``rules/pd.yaml`` with its ``split_at`` at each of ``THRESHOLDS`` (0 splits
  every request; ``never`` none, so the prefill pods stay idle).

Figures per run: TTFT p90 over every request (from its arrival; one never
answered counts as infinite), ITL p90 over every gap between two streamed
tokens of one answer (all answers' gaps pooled, not a per-request
figure), throughput (requests and output tokens completed while requests
arrive, per second), and the share of requests split.

The goal's load is the lowest of ``RATES`` where the baseline's ITL p90 is
at least twice its unloaded ITL p90 (at ``UNLOADED_RATE``), on the first
seed given.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
import yaml
from flow_quality import POD_COUNT, Contender, FlowRun, figures_of
from live_stack import metric_sum
from reporting import nearest_rank, verdict
from virtual_routing import RULES, pod_from_view, served_request

from policyd.fields.roles import BOTH, DECODE, PREFILL
from policyd.flow import unwrap
from policyd.policy import Outcome, Request
from policyd.sim.bodies import open_request, streamed
from policyd.sim.open_loop import OpenRequest, Split, _OpenRun
from policyd.sim.profile import Profile, get_profile
from policyd.sim.workloads import RagMix

# The V1 profile with the workload's output lengths (see the module docstring).
PROFILE: Final = get_profile("l4-llama3.1-8b").with_changes(output_share_of_max_tokens=None)
# 1 of the 6 pods prefills. The decode pods hold every running answer's KV cache (a
# RAG answer's 2,000-8,000 prompt tokens for its 100-300 steps), so each pod taken
# from decoding crowds the others; with 2 or 3 prefill pods at the goal's load the
# decode pods fall behind and requests queue for minutes (benchmarks/RESULTS.md,
# "P/D disaggregation", the sizing on the tuning seeds).
PREFILL_PODS: Final = 1
AGGREGATED: Final = ("lora-prefix", "prefix-aware")
NEVER: Final = 10**9  # a split_at no prompt reaches: "never split"
THRESHOLDS: Final = (0, 256, 512, 1024, 2048, 4096, NEVER)
SHIPPED_SPLIT_AT: Final = 512
UNLOADED_RATE: Final = 0.1
RATES: Final = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)
DURATION_S: Final = 300.0
# Issue 36's goals.
GOAL_LOADED_ITL: Final = 2.0  # the goal's load: the baseline's ITL p90 at this multiple of unloaded
GOAL_ITL: Final = 2.0  # P/D's ITL p90 at least this many times lower
GOAL_TTFT: Final = 1.2  # P/D's TTFT p90 no worse than this multiple
GOAL_THROUGHPUT: Final = 0.95


def roles(prefill_pods: int, pods: int = POD_COUNT) -> tuple[str, ...]:
    """The pool's roles: the first ``prefill_pods`` prefill, the rest decode (all ``both``
    when 0)."""
    if not 0 <= prefill_pods < pods:
        raise ValueError(f"a P/D pool of {pods} pods needs 0 to {pods - 1} prefill pods")
    if prefill_pods == 0:
        return (BOTH,) * pods
    return (PREFILL,) * prefill_pods + (DECODE,) * (pods - prefill_pods)


def pd_policy(split_at: int, directory: Path, when: str | None = None) -> Path:
    """``rules/pd.yaml`` with its ``split_at`` set (and its ``prefill.when`` replaced by
    ``when`` where given), written to ``directory``."""
    document = yaml.safe_load((RULES / "pd.yaml").read_text())
    document["params"]["split_at"]["value"] = split_at
    if when is not None:
        document["prefill"]["when"] = when
    path = directory / f"pd-{split_at}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def threshold_name(split_at: int) -> str:
    return "never" if split_at >= NEVER else f"split_at {split_at}"


class PdRun(FlowRun):
    """An open-loop run of ``RagMix`` on pods of given roles, a split decision served split."""

    def __init__(
        self,
        contender: Contender,
        requests: Sequence[OpenRequest],
        seed: int,
        pod_roles: Sequence[str],
        profile: Profile = PROFILE,
    ) -> None:
        if len(pod_roles) != POD_COUNT:
            raise ValueError(f"the run has {POD_COUNT} pods: give each a role")
        super().__init__(contender, requests, seed, profile)
        self.pod_roles = tuple(pod_roles)
        self._route: int | Split = -1

    def _snapshot(self) -> Any:
        snapshot = super()._snapshot()
        pods = tuple(
            pod_from_view(view, profile=self.profile, role=self.pod_roles[view.index])
            for view in self._views(self.loop.now)
        )
        return type(snapshot)(snapshot.version, pods)

    def _request(self, index: int) -> Request:
        """What ``policyd serve`` reads from the streaming client (every class streams)."""
        item = self.requests[index]
        path, body = open_request(self.profile.base_model, item.turns, item.max_tokens)
        return served_request(path, streamed(body), {}, index).request

    def _decide(self, index: int, request: Request, candidates: Sequence[Any]) -> str | None:
        probe = self.locator.probe(self.requests[index].turns) if self.locator else None
        decision = self.router.decide(request, candidates, probe)
        if decision.outcome is not Outcome.ROUTED:
            self.refuse(index, decision.outcome.http_status)
            return None
        pod = unwrap(decision.chosen)
        decode = _index(pod.name)
        split = decision.split
        self._route = decode
        if split is not None and split.split:
            self._route = Split(decode, _index(split.pod))
        if probe is not None:  # both pods of a split hold the prompt after it, as serve learns
            probe.routed(decision.target_model, pod.address)
            if split is not None and split.split:
                probe.routed(decision.target_model, split.endpoint)
        _OpenRun._send(self, index)
        return str(pod.name)

    def _chosen_pod(self, *_: object) -> int | Split:  # type: ignore[override]
        return self._route


def _index(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


@dataclass(frozen=True, slots=True)
class PdFigures:
    ttft_p90: float
    itl_p90: float  # over every gap between two streamed tokens, all answers pooled
    completed_per_s: float
    tokens_per_s: float
    split_share: float
    lost: int
    rag_ttft_p90: float
    chat_ttft_p90: float


def run_one(
    policy: Path,
    pod_roles: Sequence[str],
    rate: float,
    seed: int,
    *,
    duration_s: float = DURATION_S,
    workload: RagMix | None = None,
) -> PdFigures:
    workload = workload or RagMix()
    requests = workload.requests(rate=rate, duration_s=duration_s, seed=seed)
    run = PdRun(Contender(policy.stem, policy, prefix=True), requests, seed, pod_roles)
    outcome = run.outcome()
    base = figures_of(outcome, duration_s)
    result = outcome.result
    ttft = [
        t - arrived if (t := r.first_token) is not None and arrived is not None else float("inf")
        for r, arrived in zip(result.records, outcome.arrived, strict=True)
    ]
    groups = [r.group for r in result.records]
    rag = [t for t, g in zip(ttft, groups, strict=True) if RagMix.is_rag(g)]
    chat = [t for t, g in zip(ttft, groups, strict=True) if not RagMix.is_rag(g)]
    return PdFigures(
        ttft_p90=nearest_rank(ttft, 0.9),
        itl_p90=nearest_rank(result.token_gaps_s, 0.9),
        completed_per_s=base.completed_per_s,
        tokens_per_s=base.tokens_per_s,
        split_share=result.split_share,
        lost=base.lost,
        rag_ttft_p90=nearest_rank(rag, 0.9),
        chat_ttft_p90=nearest_rank(chat, 0.9),
    )


def goal_rate(unloaded_itl: float, itl_by_rate: Mapping[float, float]) -> float | None:
    """The lowest rate whose ITL p90 is at least ``GOAL_LOADED_ITL`` times the unloaded one."""
    for rate in sorted(itl_by_rate):
        if itl_by_rate[rate] >= GOAL_LOADED_ITL * unloaded_itl:
            return rate
    return None


def _row(name: str, runs: Sequence[PdFigures], base: Sequence[PdFigures]) -> str:
    """Means over seeds, and the same-seed ratios against ``base``."""

    def avg(values: Sequence[float]) -> float:
        return statistics.mean(values)

    itl = avg([r.itl_p90 / b.itl_p90 for r, b in zip(runs, base, strict=True)])
    ttft = avg([r.ttft_p90 / b.ttft_p90 for r, b in zip(runs, base, strict=True)])
    tok = avg([r.tokens_per_s / b.tokens_per_s for r, b in zip(runs, base, strict=True)])
    return (
        f"| {name} | {avg([r.itl_p90 for r in runs]) * 1000:.0f} | {itl:.2f} "
        f"| {avg([r.ttft_p90 for r in runs]):.2f} | {ttft:.2f} "
        f"| {avg([r.rag_ttft_p90 for r in runs]):.2f} | {avg([r.chat_ttft_p90 for r in runs]):.2f} "
        f"| {avg([r.tokens_per_s for r in runs]):.0f} | {tok:.3f} "
        f"| {avg([r.split_share for r in runs]):.0%} | {avg([r.lost for r in runs]):.1f} |"
    )


HEADER: Final = (
    "| contender | ITL p90 ms | / base | TTFT p90 s | / base | RAG TTFT p90 | chat TTFT p90 "
    "| tok/s | / base | split | lost |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=100)
    parser.add_argument("--duration", type=float, default=DURATION_S)
    parser.add_argument("--prefill-pods", type=int, default=PREFILL_PODS)
    parser.add_argument("--rate", type=float, help="the goal's load, instead of finding it")
    parser.add_argument(
        "--find-seed", type=int, default=100, help="the seed the goal's load is found on"
    )
    parser.add_argument("--when", help="another split predicate for rules/pd.yaml's prefill stage")
    arguments = parser.parse_args()
    seeds = range(arguments.first_seed, arguments.first_seed + arguments.seeds)
    started = time.monotonic()
    aggregated = roles(0)
    pool = roles(arguments.prefill_pods)
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        rate = arguments.rate
        if rate is None:
            seed = arguments.find_seed
            print(f"finding the goal's load on seed {seed} ({arguments.duration:g} s runs)")
            for name in AGGREGATED:
                policy = RULES / f"{name}.yaml"
                idle = run_one(
                    policy, aggregated, UNLOADED_RATE, seed, duration_s=arguments.duration
                )
                curve = {
                    r: run_one(policy, aggregated, r, seed, duration_s=arguments.duration).itl_p90
                    for r in RATES
                }
                found = goal_rate(idle.itl_p90, curve)
                print(
                    f"  {name}: unloaded ITL p90 {idle.itl_p90 * 1000:.0f} ms; "
                    + ", ".join(f"{r:g}/s {v * 1000:.0f}" for r, v in curve.items())
                    + f" -> {found}"
                )
                if found is not None:
                    rate = found if rate is None else min(rate, found)
            if rate is None:
                raise SystemExit("no rate of RATES doubles the unloaded ITL p90")
        print(
            f"\nload {rate:g} requests/s, seeds {seeds.start}-{seeds.stop - 1}, "
            f"{arguments.duration:g} s, {arguments.prefill_pods} prefill + "
            f"{POD_COUNT - arguments.prefill_pods} decode pods"
        )
        runs: dict[str, list[PdFigures]] = {}
        for seed in seeds:
            for name in AGGREGATED:
                runs.setdefault(name, []).append(
                    run_one(
                        RULES / f"{name}.yaml",
                        aggregated,
                        rate,
                        seed,
                        duration_s=arguments.duration,
                    )
                )
            for split_at in THRESHOLDS:
                runs.setdefault(threshold_name(split_at), []).append(
                    run_one(
                        pd_policy(split_at, directory, arguments.when),
                        pool,
                        rate,
                        seed,
                        duration_s=arguments.duration,
                    )
                )
    base_name = min(AGGREGATED, key=lambda n: statistics.mean(r.itl_p90 for r in runs[n]))
    base = runs[base_name]
    print(f"\nbaseline (aggregated, lower ITL p90): {base_name}\n")
    print("\n".join(HEADER))
    for name, found in runs.items():
        print(_row(name, found, base))
    print()
    print("\n".join(goals(runs, base_name)))
    print(f"\n{time.monotonic() - started:.0f} s")


def goals(runs: Mapping[str, Sequence[PdFigures]], base_name: str) -> list[str]:
    """Issue 36's goals on these runs: the shipped P/D against the baseline, and the
    shipped threshold against always and never splitting."""
    base = runs[base_name]
    shipped = runs[threshold_name(SHIPPED_SPLIT_AT)]

    def ratio(a: Sequence[PdFigures], b: Sequence[PdFigures], field: str) -> float:
        return statistics.mean(
            getattr(x, field) / getattr(y, field) for x, y in zip(a, b, strict=True)
        )

    itl = ratio(base, shipped, "itl_p90")
    ttft = ratio(shipped, base, "ttft_p90")
    tok = ratio(shipped, base, "tokens_per_s")
    lines = [
        f"- ITL p90 {base_name} / P/D: {itl:.2f}x (goal >= {GOAL_ITL:g}x): "
        f"{verdict(itl >= GOAL_ITL)}",
        f"- TTFT p90 P/D / {base_name}: {ttft:.2f}x (goal <= {GOAL_TTFT:g}x): "
        f"{verdict(ttft <= GOAL_TTFT)}",
        f"- output tokens/s P/D / {base_name}: {tok:.1%} (goal >= {GOAL_THROUGHPUT:.0%}): "
        f"{verdict(tok >= GOAL_THROUGHPUT)}",
    ]
    for other in (threshold_name(0), threshold_name(NEVER)):
        t = ratio(shipped, runs[other], "ttft_p90")
        i = ratio(shipped, runs[other], "itl_p90")
        lines.append(
            f"- shipped / {other}: TTFT p90 {t:.2f}x, ITL p90 {i:.2f}x "
            f"(goal: both <= 1, one < 1): {verdict(t <= 1 and i <= 1 and min(t, i) < 1)}"
        )
    return lines


# --- live (``live.py --workload rag``) ------------------------------------------------------

# The live cells: aggregated serving alone at the unloaded rate (the goal's reference
# ITL), every contender at the goal's load found in virtual time (``RATES``'s sweep,
# tuning seed 100; ``--rag-rate`` runs another).
GOAL_RATE: Final = 6.0
LIVE_AGGREGATED: Final = AGGREGATED[0]
LIVE_SHIPPED: Final = "pd"
LIVE_PICKERS: Final = (LIVE_AGGREGATED, LIVE_SHIPPED, "pd split_at 0", "pd never")
UNLOADED: Final = "unloaded"
PD_DECISIONS: Final = "policyd_pd_decisions_total"


def live_split_at(picker: str) -> int | None:
    """The ``split_at`` a live P/D contender runs (``None``: the shipped policy's own;
    raises for an aggregated picker)."""
    if picker == LIVE_SHIPPED:
        return None
    name = picker.removeprefix(f"{LIVE_SHIPPED} ")
    for split_at in THRESHOLDS:
        if threshold_name(split_at) == name:
            return split_at
    raise ValueError(f"not a P/D contender: {picker}")


def live_figures(outcomes: Sequence[Any], scale: float) -> dict[str, float]:
    """A live cell's P/D figures from its clients' outcomes (``live_stack.Outcome``: wall
    seconds, ``scale`` simulated seconds each): ITL p90 over every gap between two tokens
    of one answer (all answers pooled), and TTFT p90 of the RAG questions and of the chat
    turns from their send (one without a first token is infinitely slow)."""
    gaps = [gap * scale for o in outcomes for gap in o.gaps]

    def ttft(rag: bool) -> float:
        values = [
            (o.first - o.sent) * scale if o.first is not None else math.inf
            for o in outcomes
            if o.sent is not None and RagMix.is_rag(o.group) == rag
        ]
        return nearest_rank(values, 0.9)

    return {
        "itl p90": nearest_rank(gaps, 0.9),
        "rag ttft p90": ttft(True),
        "chat ttft p90": ttft(False),
    }


async def live_policyd_figures(monitoring_port: int) -> dict[str, float]:
    """The share of routed requests policyd split (its ``policyd_pd_decisions_total``)."""
    url = f"http://127.0.0.1:{monitoring_port}/metrics"
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response,
    ):
        text = await response.text()
    decided = metric_sum(text, PD_DECISIONS)
    split = metric_sum(text, PD_DECISIONS, 'split="true"')
    return {"split": split / decided if decided else 0.0}


def live_table(
    group: tuple[str, str, float],
    pickers: Mapping[str, Sequence[Any]],
    unloaded: Sequence[Any],
) -> list[str]:
    """The live P/D cells' table (``live_report.CellRun``s with ``pd`` figures) and issue
    36's goals: ratios paired per repeat against aggregated serving's, medians over
    repeats; ``unloaded`` is aggregated serving's cells at the unloaded rate."""
    workload, load, scale = group
    reference = pickers.get(LIVE_AGGREGATED, [])

    def median(runs: Sequence[Any], figure: Callable[[Any], float]) -> float:
        return float(statistics.median(figure(r) for r in runs)) if runs else math.nan

    def paired(runs: Sequence[Any], other: Sequence[Any], figure: Callable[[Any], float]) -> float:
        by = {r.repeat: r for r in other}
        ratios = [figure(r) / figure(by[r.repeat]) for r in runs if r.repeat in by]
        return float(statistics.median(ratios)) if ratios else math.nan

    def itl(run: Any) -> float:
        return float(run.pd["itl p90"])

    def ttft(run: Any) -> float:
        return float(run.ttft_p90)

    def tokens(run: Any) -> float:  # while requests arrive, as the virtual runs count
        return float(run.window_tokens_per_s)

    rows = [
        f"**{workload}, {load}, time scale {scale:g}** (median over repeats; / base: "
        f"paired with {LIVE_AGGREGATED}, aggregated)",
        "",
        "| picker | ITL p90 ms | / base | TTFT p90 s | / base | RAG TTFT p90 | chat TTFT p90 "
        "| tok/s while arriving | / base | split | lost |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for picker, runs in sorted(pickers.items()):
        rows.append(
            f"| {picker} | {median(runs, itl) * 1000:.0f} | {paired(runs, reference, itl):.2f} "
            f"| {median(runs, ttft):.2f} | {paired(runs, reference, ttft):.2f} "
            f"| {median(runs, lambda r: r.pd['rag ttft p90']):.2f} "
            f"| {median(runs, lambda r: r.pd['chat ttft p90']):.2f} "
            f"| {median(runs, tokens):.0f} | {paired(runs, reference, tokens):.3f} "
            f"| {median(runs, lambda r: r.pd.get('split', 0.0)):.0%} "
            f"| {median(runs, lambda r: r.lost):.0f} |"
        )
    shipped = pickers.get(LIVE_SHIPPED, [])
    if not reference or not shipped:
        return rows
    loaded = median(reference, itl) / median(unloaded, itl) if unloaded else math.nan
    base_itl = 1 / paired(shipped, reference, itl)
    base_ttft = paired(shipped, reference, ttft)
    base_tokens = paired(shipped, reference, tokens)
    rows += [
        "",
        f"- {LIVE_AGGREGATED}'s ITL p90 here / unloaded: {loaded:.2f}x (the goal's load: "
        f">= {GOAL_LOADED_ITL:g}x): {verdict(loaded >= GOAL_LOADED_ITL)}",
        f"- ITL p90 {LIVE_AGGREGATED} / P/D: {base_itl:.2f}x (goal >= {GOAL_ITL:g}x): "
        f"{verdict(base_itl >= GOAL_ITL)}",
        f"- TTFT p90 P/D / {LIVE_AGGREGATED}: {base_ttft:.2f}x (goal <= {GOAL_TTFT:g}x): "
        f"{verdict(base_ttft <= GOAL_TTFT)}",
        f"- output tokens/s P/D / {LIVE_AGGREGATED}: {base_tokens:.1%} (goal >= "
        f"{GOAL_THROUGHPUT:.0%}): {verdict(base_tokens >= GOAL_THROUGHPUT)}",
    ]
    for other in LIVE_PICKERS[2:]:
        if other not in pickers:
            continue
        t = paired(shipped, pickers[other], ttft)
        i = paired(shipped, pickers[other], itl)
        rows.append(
            f"- {LIVE_SHIPPED} / {other}: TTFT p90 {t:.2f}x, ITL p90 {i:.2f}x "
            f"(goal: both <= 1, one < 1): {verdict(t <= 1 and i <= 1 and min(t, i) < 1)}"
        )
    return rows


if __name__ == "__main__":
    main()
