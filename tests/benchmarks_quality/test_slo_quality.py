"""The wiring of benchmarks/slo_quality.py and the SLO workload (issue 35).

Not a quality claim (the benchmark's job): the workload's classes state their
objectives as llm-d's clients do and the serving path reads them; a virtual
run teaches the router's latency models only for a policy that reads them,
refuses only sheddable requests, and its counterfactual routes what it
refused; the live figures are counted from the clients' outcomes. Then a
small live run through the real Envoy and ``policyd serve``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import yaml
from benchmarks_support import load_benchmark

from policyd.policy import PolicyStore
from policyd.sim.workloads import BATCH, INTERACTIVE, SHEDDABLE, SloMix


@pytest.fixture(scope="module")
def slo() -> ModuleType:
    return load_benchmark("slo_quality")


@pytest.fixture(scope="module")
def live(slo: ModuleType) -> ModuleType:
    return load_benchmark("live")


def test_the_classes_share_the_rate_and_state_their_objectives(slo: ModuleType) -> None:
    requests = SloMix().requests(rate=20.0, duration_s=60.0, seed=4)
    counts = {c.name: sum(1 for r in requests if r.group == c.name) for c in SloMix().classes}
    assert set(counts) == {"interactive", "batch", "sheddable"}
    assert counts["interactive"] > counts["batch"] > counts["sheddable"] > 100
    batch = [len(r.prompt) for r in requests if r.group == "batch"]
    chat = [len(r.prompt) for r in requests if r.group == "interactive"]
    assert min(batch) > max(chat)  # documents against chat questions
    assert SloMix().requests(rate=20.0, duration_s=60.0, seed=4) == requests  # seeded
    # What the serving path reads from each class's client.
    read = {}
    for kind in (INTERACTIVE, BATCH, SHEDDABLE):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        if kind.streamed:
            body = {**body, "stream": True}
        read[kind.name] = slo.served_request("/v1/chat/completions", body, kind.headers(), 1)
    interactive = read["interactive"].request
    assert (interactive.slo_ttft_ms, interactive.slo_tpot_ms) == (1000.0, 250.0)
    assert interactive.stream and not read["batch"].request.stream
    assert (read["batch"].request.slo_ttft_ms, read["batch"].request.slo_tpot_ms) == (0.0, 0.0)
    assert read["sheddable"].request.slo_ttft_ms == 1000.0
    assert SHEDDABLE.headers()["x-gateway-inference-criticality"] == "sheddable"
    with pytest.raises(KeyError):
        SloMix().of("nobody")


def test_a_run_teaches_the_models_only_for_a_policy_that_reads_them(slo: ModuleType) -> None:
    requests = SloMix().requests(rate=6.0, duration_s=40.0, seed=2)
    runs = {}
    for name, policy in (("lora-prefix", slo.COMBINED), ("slo", slo.SLO_POLICY)):
        run = slo.SloRun(slo.Contender(name, policy, prefix=True), SloMix(), requests, 2)
        runs[name] = (run, run.outcome())
    plain, _ = runs["lora-prefix"]
    assert not plain.models.fits  # its decisions read no prediction: nothing learned
    assert all(d is None or d.predicted is None for d in plain.decisions)
    run, result = runs["slo"]
    assert len(run.models.fits) == slo.POD_COUNT
    predicted = [d.predicted for d in run.decisions if d is not None and d.predicted is not None]
    assert predicted[0] == (-1.0, -1.0)  # cold at first
    late = [p for p in predicted[-50:] if p[0] >= 0]
    assert late and all(p[1] > 0 for p in late)  # warm by the end, TPOT too
    figures = slo.slo_figures(result, SloMix(), run.decisions, 40.0)
    assert figures.classes["interactive"].offered + figures.classes["batch"].offered + (
        figures.classes["sheddable"].offered
    ) == len(requests)
    assert figures.refused_classes <= {"sheddable"}
    assert len(figures.met) == len(requests)


def test_the_run_keeps_each_pods_queued_prefill_as_the_serving_path_does(
    slo: ModuleType,
) -> None:
    """Decisions see the prefill policyd sent each pod with no first token yet (the
    pods from ``pod_from_view`` leave it at 0), and every request gives it back."""
    requests = SloMix().requests(rate=8.0, duration_s=30.0, seed=3)
    run = slo.SloRun(slo.Contender("slo", slo.SLO_POLICY, prefix=True), SloMix(), requests, 3)
    run.outcome()
    seen = [d.chosen_queued_prefill for d in run.decisions if d is not None]
    assert max(seen) > 0
    assert run.queued == [0] * slo.POD_COUNT


def test_replicas_each_learn_from_the_answers_they_routed(slo: ModuleType) -> None:
    requests = SloMix().requests(rate=6.0, duration_s=30.0, seed=5)
    contender = slo.Contender("slo", slo.SLO_POLICY, prefix=True)
    run = slo.SloRun(contender, SloMix(), requests, 5, replicas=2)
    run.outcome()
    first, second = run.replica_models
    assert first.fits and second.fits and first is not second
    taught = {
        name: (first.fits[name].ttft.samples, second.fits[name].ttft.samples) for name in first.fits
    }
    # Each replica took every other request and learned from those only: about half each.
    mine, theirs = sum(a for a, _ in taught.values()), sum(b for _, b in taught.values())
    assert mine + theirs <= len(requests)
    assert 0.3 < mine / (mine + theirs) < 0.7


def test_the_counterfactual_routes_what_the_policy_would_refuse(
    slo: ModuleType, tmp_path: Path
) -> None:
    shipped = yaml.safe_load(slo.SLO_POLICY.read_text())
    shed = [n for n, node in shipped["filters"].items() if "shed" in node]
    assert shed  # slo.yaml refuses sheddable requests no pod is predicted to make in time
    anyway = slo.run_anyway(slo.SLO_POLICY, tmp_path)
    changed = yaml.safe_load(anyway.read_text())
    assert not [n for n, node in changed["filters"].items() if "shed" in node]
    assert list(changed["filters"]) == list(shipped["filters"])  # the walk starts the same
    assert changed["score"] == shipped["score"]
    PolicyStore.open(anyway)  # a valid policy


def test_prediction_errors_count_after_the_warm_up(slo: ModuleType) -> None:
    from flow_quality import FlowResult

    from policyd.policy import Decision, Outcome
    from policyd.sim.open_loop import OpenLoopResult, OpenRecord

    def record(i: int, ttft: float) -> OpenRecord:
        return OpenRecord(i, "m", "interactive", 0.0, 0, ttft, ttft + 1.0, 10, 0, 11)

    count = slo.WARMUP + 3
    records = tuple(record(i, 0.5) for i in range(count))
    run = FlowResult(OpenLoopResult(records, 2.0, 1), (0.0,) * count, (None,) * count, 0, 0)

    def decision(predicted: tuple[float, float]) -> Decision:
        return Decision(Outcome.ROUTED, "p", "1", "m", predicted=predicted)

    decisions = [decision((600.0, 50.0))] * count
    decisions[-1] = decision((-1.0, -1.0))
    ttft, tpot, cold = slo.prediction_errors(run, decisions)
    assert ttft == pytest.approx([20.0, 20.0])  # 600 ms predicted, 500 ms seen
    assert tpot == pytest.approx([50.0, 50.0])  # 50 ms predicted, 100 ms a token seen
    assert cold == 1


def test_live_figures_count_each_class_against_its_objectives(slo: ModuleType) -> None:
    from live_stack import Outcome

    outcomes = [
        Outcome("interactive", True, sent=0.0, first=0.3, done=2.3, tokens=11),  # 0.6 s, 0.4 s
        Outcome("interactive", True, sent=0.0, first=0.6, done=1.6, tokens=11),  # 1.2 s
        Outcome("interactive", True, sent=0.0, answer="client TimeoutError"),
        Outcome("batch", False, sent=0.0, done=30.0, tokens=100),
        Outcome("sheddable", True, sent=0.0, answer="429 shed"),
        Outcome("sheddable", True, sent=0.0, first=0.1, done=1.0, tokens=5),
    ]
    found = slo.live_figures(outcomes, 2.0, SloMix())  # a time scale of 2
    assert found["interactive ttft met"] == pytest.approx(1 / 3)
    assert found["interactive tpot met"] == pytest.approx(1 / 2)  # 400 ms and 200 ms a token
    assert found["interactive completed"] == 2
    assert found["batch ttft met"] == 1.0  # no objective: answered at all
    assert (found["sheddable refused"], found["sheddable ttft met"]) == (1, 0.5)
    assert "batch tpot met" not in found


def test_the_prediction_error_median_is_read_to_its_bucket(slo: ModuleType) -> None:
    name = slo.PREDICTION_ERROR
    page = "\n".join(
        f'{name}{{policy="slo",model_name="m",latency="{latency}",le="{le}"}} {count}'
        for latency, buckets in (
            ("ttft", (("0.1", 1), ("0.2", 4), ("0.3", 9), ("+Inf", 10))),
            ("tpot", (("0.05", 8), ("0.1", 9), ("+Inf", 10))),
        )
        for le, count in buckets
    )
    assert slo.histogram_median(page, "ttft") == (0.2, 0.3)
    assert slo.histogram_median(page, "tpot") == (0.0, 0.05)
    assert all(math.isnan(v) for v in slo.histogram_median("", "ttft"))


def test_live_runs_the_slo_workload_as_cells_of_its_own(live: ModuleType) -> None:
    assert "slo" not in live.parse([]).workload  # the V1 profile's only: not by default
    argv = ["--workload", "slo", "--profile", "l4-llama3.1-8b", "--time-scale", "1",
            "--repeats", "1"]  # fmt: skip
    arguments = live.parse(argv)
    cells = [c for b in live.plan(arguments) for c in b]
    loads = ("knee 6/s", "goal 8/s", "1.5x 9/s", "2x 12/s")  # the range
    assert {(c.load, c.picker) for c in cells} == {
        (load, picker) for load in loads for picker in ("lora-prefix", "slo")
    }
    chosen = live.parse([*argv, "--slo-loads", "2x", "knee"])
    assert {c.load for b in live.plan(chosen) for c in b} == {"knee 6/s", "2x 12/s"}
    for argv in (["--workload", "slo"], ["--workload", "slo", "--virtual"]):
        with pytest.raises(SystemExit) as stopped:
            live.parse([*argv, "--profile", "l4-llama3.1-8b"] if "--virtual" in argv else argv)
        assert stopped.value.code == 2


@pytest.mark.e2e
def test_a_small_live_slo_run_states_its_objectives_through_envoy(
    live: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "live.json"
    lines = live.main(
        ["--workload", "slo", "--profile", "l4-llama3.1-8b", "--time-scale", "10",
         "--repeats", "1", "--duration", "6", "--slo-loads", "knee", "goal",
         "--json", str(out), "--logs", str(tmp_path)]
    )  # fmt: skip
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["load"], r["picker"]) for r in runs) == [
        ("goal 8/s", "lora-prefix"), ("goal 8/s", "slo"),
        ("knee 6/s", "lora-prefix"), ("knee 6/s", "slo"),
    ]  # fmt: skip
    for run in runs:
        figures = run["slo"]
        assert run["completed"] > 0
        assert figures["interactive offered"] > 0 and figures["batch offered"] > 0
        # policyd read the objective headers of every answered interactive and
        # sheddable request: Envoy passed them through.
        stated = figures["interactive completed"] + figures["sheddable completed"]
        assert figures["policyd ttft stated"] == stated
        assert 0.0 <= figures["interactive ttft met"] <= 1.0
    assert sum(line.startswith("| slo |") for line in lines) == 2


def test_a_reference_cell_that_completed_nothing_gives_no_ratio(slo: ModuleType) -> None:
    """A loaded machine can leave a cell with no completions while requests arrived: its
    ratio is unknown, not a division by zero."""
    cell = SimpleNamespace(window_per_s=2.0, tokens_per_s=300.0)
    empty = SimpleNamespace(window_per_s=0.0, tokens_per_s=0.0)
    half = SimpleNamespace(window_per_s=4.0, tokens_per_s=600.0)
    assert slo._median_ratio([(cell, empty)], "window_per_s") == "-"
    assert slo._median_ratio([(cell, empty), (cell, half)], "tokens_per_s") == "50.0%"
