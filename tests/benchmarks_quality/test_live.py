"""benchmarks/live.py's pure parts, and one small live run through the real Envoy.

Not a quality claim (that is the benchmark's job): the arguments, the
interleaved plan, the ceiling (a true upper bound on the hit rate), the
figures over repeats and the tables; then a few requests through real
``policyd serve``, Envoy and simulated pods, asserting what happened to them,
never how fast.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import ModuleType

import aiohttp
import pytest
import yaml
from benchmarks_support import load_benchmark

from policyd.sim.open_loop import Oracle, run_open_loop
from policyd.sim.profile import get_profile
from policyd.sim.workloads import SharedPrefix


@pytest.fixture(scope="module")
def live() -> ModuleType:
    return load_benchmark("live")


@pytest.fixture(scope="module")
def report(live: ModuleType) -> ModuleType:
    return sys.modules["live_report"]


@pytest.fixture(scope="module")
def stack(live: ModuleType) -> ModuleType:
    return sys.modules["live_stack"]


# --- arguments and plan ---------------------------------------------------------------------


def test_the_defaults_are_the_issues_run(live: ModuleType) -> None:
    arguments = live.parse([])
    assert arguments.time_scale == [0.5, 1.0, 3.0]
    assert arguments.repeats == 3
    assert arguments.workload == [
        "seed", "shared-prefix", "mixed", "multi-turn", "tenants", "priorities"
    ]  # fmt: skip
    # every shipped policy, random and lora-balanced among them, not the test files
    assert {"random", "lora-balanced", "lora-prefix", "default"} <= set(arguments.pickers)
    assert not any(p.endswith(".test") for p in arguments.pickers)
    assert arguments.duration == 200.0
    assert live.parse(["--quick"]).duration == live.QUICK_DURATION_S
    assert live.seed_workload(live.parse(["--quick"])).requests == live.QUICK_REQUESTS
    assert live.seed_workload(arguments).connections == 100


@pytest.mark.parametrize(
    "argv",
    [
        ["--pickers", "no-such-policy"],
        ["--repeats", "0"],
        ["--time-scale", "0"],
        ["--profile", "no-such-profile"],
        ["--workload", "nothing"],
        ["--flow-pickers", "flow"],  # none, the goals' reference, is missing
        ["--multiples", "0"],
        ["--replicas", "0"],
        ["--prefix-index", "exact"],
    ],
)
def test_bad_arguments_stop_with_a_usage_error(live: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        live.parse(argv)
    assert stopped.value.code == 2


def test_the_plan_interleaves_pickers_and_runs_each_once_per_repeat(live: ModuleType) -> None:
    pickers = ["random", "default", "lora-balanced", "lora-prefix", "scorers"]
    arguments = live.parse(
        ["--workload", "seed", "--time-scale", "3", "--repeats", "4", "--parallel", "2",
         "--pickers", *pickers]
    )  # fmt: skip
    batches = live.plan(arguments)
    assert all(1 <= len(b) <= 2 for b in batches)
    cells = [c for b in batches for c in b]
    orders = []
    for repeat in range(4):
        mine = [c.picker for c in cells if c.repeat == repeat]
        assert sorted(mine) == sorted(pickers)
        orders.append(tuple(mine))
    assert len(set(orders)) > 1  # shuffled per repeat, not one fixed order
    assert live.plan(arguments) == batches  # seeded


def test_replicas_and_prefix_modes_multiply_the_pickers_and_name_them(live: ModuleType) -> None:
    arguments = live.parse(
        ["--workload", "shared-prefix", "--time-scale", "1", "--repeats", "1",
         "--pickers", "lora-prefix", "--replicas", "1", "2", "--prefix-index", "approximate",
         "precise"]
    )  # fmt: skip
    cells = [c for b in live.plan(arguments) for c in b]
    knee = [c for c in cells if c.load.startswith("knee")]
    assert sorted((c.replicas, c.prefix_index) for c in knee) == [
        (1, "approximate"), (1, "precise"), (2, "approximate"), (2, "precise")
    ]  # fmt: skip
    assert sorted(c.name for c in knee) == [
        "lora-prefix", "lora-prefix precise", "lora-prefix precise x2", "lora-prefix x2"
    ]  # fmt: skip
    # each cell's logs go to a directory of its own
    assert len({live.cell_directory(c) for c in cells}) == len(cells)


def test_flow_workloads_run_their_contenders_and_an_idle_reference(live: ModuleType) -> None:
    arguments = live.parse(["--workload", "tenants", "--time-scale", "1", "--repeats", "1"])
    cells = [c for b in live.plan(arguments) for c in b]
    by_load: dict[str, set[str]] = {}
    for cell in cells:
        by_load.setdefault(cell.load, set()).add(cell.picker)
    contenders = {"none", "flow", "flow+lora-prefix", "rules/flow.yaml"}
    assert by_load == {"idle": {"none"}, "2x": contenders, "3x": contenders}
    chosen = live.parse(
        ["--workload", "priorities", "--multiples", "1.5", "3", "--flow-pickers", "none",
         "rules/flow.yaml", "--repeats", "1", "--time-scale", "1"]
    )  # fmt: skip
    by_load = {}
    for cell in (c for b in live.plan(chosen) for c in b):
        by_load.setdefault(cell.load, set()).add(cell.picker)
    shipped = {"none", "rules/flow.yaml"}
    assert by_load == {"idle": {"none"}, "1.5x": shipped, "3x": shipped}
    assert [label for label, _ in live.loads("shared-prefix")] == ["knee 1/s", "1.5x knee 1.5/s"]
    assert live.loads("multi-turn")[1][1] == 6.0
    # Each profile has its own knees and capacity.
    assert live.loads("mixed", "l4-llama3.1-8b")[0] == ("knee 3.5/s", 3.5)
    assert live.loads("tenants", "l4-llama3.1-8b")[1] == (
        "2x",
        2 * live.CAPACITIES["l4-llama3.1-8b"],
    )


def test_a_flow_contender_gets_the_flow_section_scaled_to_the_pods(
    live: ModuleType, tmp_path: Path
) -> None:
    cell = live.Cell("tenants", "2x", 23.0, 3.0, "flow+lora-prefix", 0)
    policy = live.policy_of("flow+lora-prefix", cell, tmp_path)
    text = policy.read_text()
    assert text.startswith((live.RULES / "lora-prefix.yaml").read_text().rstrip("\n"))
    assert "flow:" in text and "max_wait: 20s" in text  # 60 s of simulated time at 3x
    assert live.policy_of("none", cell, tmp_path) == live.RULES / "default.yaml"
    shipped = yaml.safe_load(live.policy_of(live.SHIPPED_FLOW, cell, tmp_path).read_text())
    original = yaml.safe_load((live.RULES / "flow.yaml").read_text())
    assert shipped["score"] == original["score"]
    assert shipped["flow"]["saturated"] == original["flow"]["saturated"]
    assert shipped["flow"]["bands"]["critical"]["max_wait"] == "20s"
    assert shipped["flow"]["bands"]["sheddable"]["max_wait"] == "3.33333s"
    seed = live.Cell("seed", "burst", 0.0, 3.0, "random", 0)
    assert live.policy_of("random", seed, tmp_path) == live.RULES / "random.yaml"


def test_pod_lengths_cap_the_pods_own_draw_at_max_tokens(live: ModuleType) -> None:
    from policyd.sim.profile import L4_LLAMA2_7B

    plain = SharedPrefix().requests(rate=2.0, duration_s=30.0, seed=3)
    drawn = live.PodLengths(SharedPrefix(), L4_LLAMA2_7B).requests(
        rate=2.0, duration_s=30.0, seed=3
    )
    assert [r.prompt for r in drawn] == [r.prompt for r in plain]
    assert all(L4_LLAMA2_7B.output_tokens_min <= r.output_length <= r.max_tokens for r in drawn)
    assert any(r.output_length < r.max_tokens for r in drawn)


# --- the ceiling ----------------------------------------------------------------------------


def test_the_ceiling_counts_later_copies_of_shared_full_blocks(report: ModuleType) -> None:
    shared = list(range(100, 132))  # two full blocks of 16
    first = [*shared, 1, 2, 3]
    second = [*shared, 4, 5, 6, 7]
    other_model = [*shared, 8]
    ceiling = report.ceiling([("m", first), ("m", second), ("lora", other_model)], 16)
    # only the second request can hit, on its 2 shared blocks; another model shares nothing
    assert ceiling == pytest.approx(2 * 16 / (35 + 36 + 33))
    assert report.ceiling([("m", first)], 16) == 0.0
    assert report.ceiling([], 16) == 0.0


def test_the_ceiling_bounds_the_oracles_hit_rate(report: ModuleType) -> None:
    requests = SharedPrefix().requests(rate=2.0, duration_s=60.0, seed=5)
    result = run_open_loop(Oracle(), requests, seed=5)
    ceiling = report.ceiling([("meta-llama/Llama-2-7b-hf", r.prompt) for r in requests], 16)
    assert 0.3 < result.hit_rate <= ceiling < 1.0


# --- figures over repeats -------------------------------------------------------------------


def _run(report: ModuleType, picker: str, repeat: int, **figures: float) -> object:
    base = {
        "workload": "seed", "load": "burst", "rate": 0.0, "time_scale": 3.0, "picker": picker,
        "repeat": repeat, "offered": 100, "sent": 100, "completed": 90, "answered": 0,
        "lost": 10, "output_tokens": 9000, "duration_s": 100.0, "tokens_per_s": 90.0,
        "ttft_p50": 1.0, "ttft_p90": 2.0, "ttft_p99": 3.0, "hit_rate": 0.2, "ceiling": 0.8,
        "busiest": 1.1, "window_per_s": 0.0, "window_tokens_per_s": 0.0,
    }  # fmt: skip
    base.update(figures)
    return report.CellRun(**base)


def test_ratios_pair_each_repeat_with_the_reference_of_the_same_run(report: ModuleType) -> None:
    runs = [
        _run(report, "random", 0, completed=50, ttft_p90=40.0),
        _run(report, "random", 1, completed=60, ttft_p90=20.0),
        _run(report, "lora-balanced", 0, completed=100, ttft_p90=4.0),
        _run(report, "lora-balanced", 1, completed=90, ttft_p90=4.0),
        _run(report, "lora-balanced", 2, completed=80, ttft_p90=4.0),
    ]
    pickers = report.grouped(runs)[("seed", "burst", 3.0)]
    done = report.paired(pickers["lora-balanced"], pickers["random"], lambda r: r.completed)
    assert (done.median, done.low, done.high) == (1.75, 1.5, 2.0)  # repeat 2 has no pair
    p90 = report.paired(
        pickers["lora-balanced"], pickers["random"], lambda r: r.ttft_p90, lower_better=True
    )
    assert (p90.low, p90.high) == (5.0, 10.0)
    spread = report.Spread.of([r.completed for r in pickers["lora-balanced"]])
    assert spread.show(".0f") == "90 (80-100)"
    assert report.Spread.of([7.0]).show(".1f") == "7.0"


def test_the_table_has_a_row_per_picker_with_gains_against_both_references(
    report: ModuleType,
) -> None:
    runs = [
        _run(report, "random", 0, completed=50, tokens_per_s=50.0, ttft_p90=40.0),
        _run(report, "lora-balanced", 0, completed=100, tokens_per_s=100.0, ttft_p90=4.0),
        _run(report, "lora-prefix", 0, completed=100, tokens_per_s=110.0, ttft_p90=2.0),
    ]
    ((group, pickers),) = report.grouped(runs).items()
    rows = report.table(group, pickers)
    assert rows[0].startswith("**seed, burst, time scale 3**")
    row = next(r for r in rows if r.startswith("| lora-prefix |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == "100/100"
    assert cells[7] == "25%"  # hit rate 0.2 of the ceiling 0.8
    assert cells[9] == "2.00 / 2.20 / 20.00"  # against random
    assert cells[10] == "1.00 / 1.10 / 2.00"  # against lora-balanced
    assert sum(r.startswith("| ") and "---" not in r for r in rows) == 4  # header + 3 pickers


def test_the_replica_goal_pairs_each_repeat_with_one_replica_of_the_same_mode(
    live: ModuleType, report: ModuleType
) -> None:
    runs = [
        _run(report, "lora-prefix", 0, hit_rate=0.80, ttft_p90=1.00),
        _run(report, "lora-prefix", 1, hit_rate=0.80, ttft_p90=2.00),
        _run(report, "lora-prefix x2", 0, hit_rate=0.60, ttft_p90=1.50),
        _run(report, "lora-prefix x2", 1, hit_rate=0.64, ttft_p90=3.00),
        _run(report, "lora-prefix precise", 0, hit_rate=0.80, ttft_p90=1.00),
        _run(report, "lora-prefix precise x2", 0, hit_rate=0.79, ttft_p90=1.04),
        _run(report, "lora-prefix precise x3", 0, hit_rate=0.79, ttft_p90=1.06),
    ]
    ((group, pickers),) = report.grouped(runs).items()
    lines = live.replica_goals(group, pickers)
    assert len(lines) == 3  # one per picker on several replicas
    approximate = next(line for line in lines if "lora-prefix x2 / lora-prefix:" in line)
    assert "hit rate 0.775 (0.750-0.800)x" in approximate
    assert "TTFT p90 1.500x" in approximate and approximate.endswith("missed")
    precise = next(line for line in lines if "precise x2 / lora-prefix precise:" in line)
    assert "hit rate 0.988x, TTFT p90 1.040x" in precise and precise.endswith(": met")
    three = next(line for line in lines if "precise x3" in line)
    assert three.endswith("missed")  # p90 6% longer


def test_envoys_counters_are_read_from_its_stats_page(stack: ModuleType) -> None:
    page = (
        "cluster.policyd.health_check.attempt: 7\n"
        "cluster.policyd.health_check.success: 5\n"
        "cluster.policyd.health_check.success_rate: 9\n"
    )
    assert stack.envoy_stat(page, stack.HEALTH_CHECKS) == 5
    assert stack.envoy_stat("", stack.HEALTH_CHECKS) == 0


def test_the_agreement_tells_a_slipping_machine_from_a_drifting_runner(
    report: ModuleType,
) -> None:
    runs = [
        _run(report, "lora-balanced", r, completed=c, ttft_p90=2.0, pod_finished=f, pod_tokens=t)
        for r, c, f, t in ((0, 90, 96, 3900.0), (1, 88, 90, 3800.0), (2, 99, 99, 4000.0))
    ]
    twins = {("seed", "burst", "lora-balanced"): report.Virtual(100, 2.0, 4000.0)}
    (row,) = [r for r in report.agreement(runs, twins) if r.startswith("| seed")]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[3:8] == ["90 / 100", "0.900", "2.00 / 2.00", "1.000", "NO"]
    assert cells[8] == "0.975"  # the pods generated the median 3900 of 4000 tokens
    assert cells[9] == "2"  # median of 6, 2, 0 finished at the pods but not at the client


def test_throughput_while_arriving_leaves_out_what_ended_after_the_window(
    report: ModuleType, stack: ModuleType
) -> None:
    outcomes = [
        stack.Outcome("a", True, sent=0.0, first=1.0, done=4.0, tokens=100),
        stack.Outcome("a", True, sent=5.0, first=6.0, done=9.0, tokens=300),
        stack.Outcome("a", True, sent=8.0, first=20.0, done=40.0, tokens=200),  # after it
        stack.Outcome("a", True, sent=9.0, answer="client TimeoutError"),
    ]
    run = report.cell_run(
        key=("slo", "goal", 8.0, 2.0, "slo", 0), outcomes=outcomes, ended_s=40.0,
        window_s=10.0, counters=stack.PoolCounters(), ceiling_rate=0.0, rule="sent",
        pods=6, flow=False, wall_s=40.0,
    )  # fmt: skip
    # a time scale of 2: 10 wall seconds are 20 simulated
    assert (run.window_per_s, run.window_tokens_per_s) == (2 / 20, 400 / 20)
    assert run.tokens_per_s == 600 / 80  # to the last answer


def test_percentiles_count_a_request_without_a_first_token_as_infinitely_slow(
    report: ModuleType, stack: ModuleType
) -> None:
    outcomes = [stack.Outcome("g", True, sent=0.0, first=0.1 * i, done=1.0) for i in range(1, 10)]
    outcomes.append(stack.Outcome("g", True, sent=0.0, answer="client TimeoutError"))
    outcomes.append(stack.Outcome("g", False, sent=0.0, done=1.0))  # not streamed: no TTFT
    sent = report.ttft_values(outcomes, 3.0, "sent")
    assert len(sent) == 10 and math.isinf(max(sent))
    assert report.ttft_values(outcomes, 3.0, "completed") == pytest.approx(
        [0.3 * i for i in range(1, 10)]
    )
    assert math.isinf(report.tail_percentile(sent, 0.99))
    assert report.tail_percentile(sent, 0.5) == pytest.approx(1.65)  # between 1.5 and 1.8


def test_flow_goals_judge_each_contender_against_idle_and_no_flow_control(
    report: ModuleType,
) -> None:
    def classes(p90: float, goodput_done: int) -> dict[str, object]:
        return {"tenant-b": report.ClassFigures(100, goodput_done, 0, p90, p90 * 2)}

    group = ("tenants", "3x", 3.0)
    idle = [_run(report, "none", 0, workload="tenants", load="idle", classes=classes(0.2, 100))]
    pickers = {
        "none": [_run(report, "none", 0, workload="tenants", window_per_s=10.0,
                      classes=classes(30.0, 60))],
        "flow": [_run(report, "flow", 0, workload="tenants", window_per_s=9.7, lost=0,
                      classes=classes(0.4, 100))],
    }  # fmt: skip
    (line,) = report.flow_goals(group, pickers, idle)
    assert "nothing lost (0): met" in line
    assert "small tenant goodput 100.0%: met" in line
    assert "its TTFT p90 2.0x idle: met" in line
    assert "throughput 97.0% of none's: met" in line
    table = report.flow_table(group, pickers, idle)
    assert any(r.startswith("| none |") and "150.0x" in r for r in table)


def test_the_pods_and_policyds_counters_are_read_from_their_metrics(stack: ModuleType) -> None:
    page = (
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{model_name="m"} 48.0\n'
        'vllm:prefix_cache_hits_totalx{model_name="m"} 1000.0\n'
        'policyd_decisions_total{model_name="m",model_server_endpoint="vllm-1",'
        'outcome="routed",policy="p"} 3.0\n'
        'policyd_decisions_total{model_name="m",model_server_endpoint="vllm-2",'
        'outcome="routed",policy="p"} 1.0\n'
        'policyd_decisions_total{model_name="m",model_server_endpoint="",'
        'outcome="shed",policy="p"} 5.0\n'
        'policyd_pod_scrapes_total{model_server_endpoint="vllm-0",result="success"} 8.0\n'
        'policyd_pod_scrapes_total{model_server_endpoint="vllm-0",result="failure"} 2.0\n'
    )
    assert stack.metric_sum(page, "policyd_pod_scrapes_total") == 10.0
    assert stack.metric_sum(page, "policyd_pod_scrapes_total", 'result="failure"') == 2.0
    assert stack.metric_sum(page, "vllm:prefix_cache_hits_total") == 48.0
    assert stack.routed_per_pod(page) == {"vllm-1": 3.0, "vllm-2": 1.0}
    assert stack.class_headers("tenant-b", True) == {"x-tenant": "tenant-b"}
    assert stack.class_headers("sheddable", True) == {stack.CRITICALITY: "sheddable"}
    assert stack.class_headers("group-3", False) == {}


# --- live, through the real Envoy -----------------------------------------------------------


@pytest.mark.e2e
def test_a_small_live_run_serves_its_requests_through_envoy(
    live: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "live.json"
    lines = live.main(
        ["--workload", "shared-prefix", "--pickers", "random", "--time-scale", "10",
         "--repeats", "1", "--duration", "8", "--json", str(out), "--logs", str(tmp_path)]
    )  # fmt: skip
    runs = json.loads(out.read_text())["runs"]
    assert [r["load"] for r in runs] == ["knee 1/s", "1.5x knee 1.5/s"]
    for run in runs:
        assert run["offered"] > 0 and run["sent"] == run["offered"]
        assert run["completed"] > 0 and run["output_tokens"] > 0
        assert 0.0 <= run["hit_rate"] <= run["ceiling"] + 1e-9
        assert run["busiest"] >= 1.0
    assert sum(line.startswith("| random |") for line in lines) == 2


@pytest.mark.e2e
async def test_two_precise_replicas_share_the_streams_and_follow_every_pod(
    stack: ModuleType, tmp_path: Path
) -> None:
    setup = stack.Setup(
        Path(__file__).resolve().parents[2] / "rules" / "lora-prefix.yaml",
        10.0, "l4-llama3.1-8b", 100, 120.0, replicas=2, prefix_index="precise",
    )  # fmt: skip
    requests = SharedPrefix().requests(rate=7.0, duration_s=6.0, seed=3)
    async with stack.Stack(setup, tmp_path) as running:
        outcomes, _ = await stack.run_open(
            running.url, requests, base_model=get_profile("l4-llama3.1-8b").base_model,
            time_scale=10.0, timeout_s=120.0, streamed=[True] * len(requests),
            critical_default=True,
        )  # fmt: skip
        assert all(o.done is not None for o in outcomes)
        async with aiohttp.ClientSession() as session:
            pages = [
                await stack._get_text(session, f"http://127.0.0.1:{r.monitoring_port}/metrics")
                for r in running.replicas
            ]
            counted = await running.counters(session)
    assert len(pages) == 2
    routed = [sum(stack.routed_per_pod(page).values()) for page in pages]
    assert min(routed) >= len(requests) // 4, routed  # Envoy spread the streams over both
    assert sum(counted.routed.values()) == sum(routed) == len(requests)
    for page in pages:  # each replica follows every pod's KV events, not only its own routes
        followed = {
            line.partition('model_server_endpoint="')[2].partition('"')[0]
            for line in page.splitlines()
            if line.startswith("policyd_prefix_kv_event_batches")
            and float(line.rpartition(" ")[2]) > 0
        }
        assert followed == {f"vllm-{i}" for i in range(stack.PODS)}
