"""The wiring of benchmarks/pd_quality.py and the RAG workload (issue 36).

Not a quality claim (the benchmark's job): the workload's documents are
shared prefixes of the stated lengths, mixed with short chat, the same per
seed; a virtual run on a P/D pool serves a request split exactly when the
shipped policy's predicate says so (every request at ``split_at`` 0, none
at "never"), its prefill on a prefill pod and its decode on a decode pod;
the aggregated pool never splits; and the goal's load is read off the
ITL curve as the issue defines it.
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import aiohttp
import pytest
import yaml
from benchmarks_support import BENCHMARKS, load_benchmark

from policyd.fields.roles import BOTH, DECODE, PREFILL
from policyd.policy import PolicyStore
from policyd.sim.workloads import RagMix


@pytest.fixture(scope="module")
def pd() -> ModuleType:
    return load_benchmark("pd_quality")


def test_rag_questions_share_long_documents_mixed_with_short_chat() -> None:
    workload = RagMix()
    requests = workload.requests(rate=4.0, duration_s=120.0, seed=7)
    rag = [r for r in requests if RagMix.is_rag(r.group)]
    chat = [r for r in requests if not RagMix.is_rag(r.group)]
    assert 0.4 < len(rag) / len(requests) < 0.6  # half and half
    assert min(len(r.prompt) for r in rag) >= 2000
    assert max(len(r.prompt) for r in chat) < 600
    assert max(len(r.prompt) for r in rag) <= 8000 + 200  # a document and its question
    assert all(100 <= r.max_tokens == r.output_length <= 300 for r in requests)
    by_document: dict[str, set[str]] = {}
    for r in rag:
        by_document.setdefault(r.group, set()).add(r.turns[0].texts[0])
    assert 1 < len(by_document) <= workload.documents
    assert all(len(texts) == 1 for texts in by_document.values())  # one shared prefix each
    questions = [r.turns[1].texts[0] for r in rag]
    assert len(set(questions)) == len(questions)  # each question its own
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(requests)]
    assert statistics.mean(gaps) == pytest.approx(1 / 4.0, rel=0.2)  # open loop at the rate
    assert workload.requests(rate=4.0, duration_s=120.0, seed=7) == requests
    assert workload.requests(rate=4.0, duration_s=120.0, seed=8) != requests


def test_the_rag_workload_refuses_empty_ranges() -> None:
    with pytest.raises(ValueError):
        RagMix(documents=0)
    with pytest.raises(ValueError):
        RagMix(output_tokens=(300, 100))
    with pytest.raises(ValueError):
        RagMix(rag_share=1.5)


def test_pool_roles_and_threshold_policies(pd: ModuleType, tmp_path: Path) -> None:
    assert pd.roles(0) == (BOTH,) * 6
    assert pd.roles(2) == (PREFILL, PREFILL, DECODE, DECODE, DECODE, DECODE)
    with pytest.raises(ValueError):
        pd.roles(6)
    path = pd.pd_policy(1024, tmp_path)
    document = yaml.safe_load(path.read_text())
    assert document["params"]["split_at"]["value"] == 1024
    chosen = PolicyStore.open(path).current.select("any-model", {})
    assert chosen is not None and chosen.prefill is not None  # a valid two-stage policy
    when = "double(request.prompt_tokens) * (1.0 - pod.prefix_match) >= double(params.split_at)"
    (tmp_path / "other").mkdir()
    other = pd.pd_policy(1024, tmp_path / "other", when)
    assert yaml.safe_load(other.read_text())["prefill"]["when"] == when
    assert PolicyStore.open(other).current.select("any-model", {}) is not None  # it compiles
    shipped = yaml.safe_load((pd.RULES / "pd.yaml").read_text())
    assert shipped["params"]["split_at"]["value"] == pd.SHIPPED_SPLIT_AT


def test_a_pd_run_splits_what_the_predicate_says(pd: ModuleType, tmp_path: Path) -> None:
    pool = pd.roles(2)
    always = pd.run_one(pd.pd_policy(0, tmp_path), pool, 1.0, 3, duration_s=30.0)
    never = pd.run_one(pd.pd_policy(pd.NEVER, tmp_path), pool, 1.0, 3, duration_s=30.0)
    shipped = pd.run_one(pd.pd_policy(512, tmp_path), pool, 1.0, 3, duration_s=30.0)
    aggregated = pd.run_one(pd.RULES / "lora-prefix.yaml", pd.roles(0), 1.0, 3, duration_s=30.0)
    assert always.split_share == 1.0
    assert never.split_share == 0.0 == aggregated.split_share
    assert 0.0 < shipped.split_share < 1.0  # long uncached prompts only
    for figures in (always, never, shipped, aggregated):
        assert figures.lost == 0
        assert 0 < figures.itl_p90 < figures.ttft_p90 * 10
        assert figures.tokens_per_s > 0


def test_split_requests_prefill_on_prefill_pods_and_decode_elsewhere(
    pd: ModuleType, tmp_path: Path
) -> None:
    requests = RagMix().requests(rate=1.0, duration_s=30.0, seed=3)
    contender = pd.Contender("pd", pd.pd_policy(512, tmp_path), prefix=True)
    run = pd.PdRun(contender, requests, 3, pd.roles(2))
    records = run.outcome().result.records
    split = [r for r in records if r.prefill_pod is not None]
    assert split
    assert all(r.prefill_pod in (0, 1) and r.pod not in (0, 1) for r in split)
    assert all(r.pod not in (0, 1) for r in records)  # prefill pods never decode
    # The predicate reads the serving path's prompt estimate (request.prompt_tokens).
    assert all(run._request(r.index).prompt_tokens >= 512 for r in split)
    assert any(run._request(r.index).prompt_tokens < 512 for r in records)  # short chat stays
    with pytest.raises(ValueError):
        pd.PdRun(contender, requests, 3, pd.roles(2)[:5])


def test_the_goal_load_is_the_first_that_doubles_the_unloaded_itl(pd: ModuleType) -> None:
    curve = {1.0: 0.08, 2.0: 0.12, 3.0: 0.15, 4.0: 0.3}
    assert pd.goal_rate(0.074, curve) == 3.0
    assert pd.goal_rate(0.2, curve) is None


# --- live (live.py --workload rag) ----------------------------------------------------------


@pytest.fixture(scope="module")
def live(pd: ModuleType) -> ModuleType:
    return load_benchmark("live")


def test_token_gaps_skip_the_role_and_the_trailer_and_keep_coalesced_tokens(
    live: ModuleType,
) -> None:
    stack = sys.modules["live_stack"]
    # role + first token together, then 2 tokens in one chunk, then the last token,
    # then usage + [DONE]
    arrivals = [(1.0, 2), (1.5, 2), (2.25, 1), (2.5, 2)]
    assert stack.token_gaps(arrivals, 1, 4) == [0.5, 0.0, 0.75]
    assert stack.token_gaps(arrivals, 0, 4) == [0.0, 0.5, 0.0]  # a completions stream
    assert stack.token_gaps([(1.0, 3)], 0, 1) == []


def test_live_runs_the_rag_workload_aggregated_unloaded_and_every_contender_loaded(
    pd: ModuleType, live: ModuleType, tmp_path: Path
) -> None:
    assert "rag" not in live.parse([]).workload  # the V1 profile's only: not by default
    argv = ["--workload", "rag", "--profile", "l4-llama3.1-8b", "--time-scale", "1",
            "--repeats", "1", "--rag-rate", "5"]  # fmt: skip
    cells = [c for b in live.plan(live.parse(argv)) for c in b]
    assert {(c.load, c.picker) for c in cells} == {("unloaded 0.1/s", "lora-prefix")} | {
        ("5/s", p) for p in ("lora-prefix", "pd", "pd split_at 0", "pd never")
    }
    by_picker = {c.picker: c for c in cells if c.load == "5/s"}
    shipped = live.policy_of("pd", by_picker["pd"], tmp_path)
    assert shipped == BENCHMARKS.parent / "rules" / "pd.yaml"
    for picker, split_at in (("pd split_at 0", 0), ("pd never", pd.NEVER)):
        written = yaml.safe_load(live.policy_of(picker, by_picker[picker], tmp_path).read_text())
        assert written["params"]["split_at"]["value"] == split_at
    with pytest.raises(SystemExit) as stopped:
        live.parse(["--workload", "rag"])  # the default profile is not V1
    assert stopped.value.code == 2


def test_the_live_table_judges_pd_against_aggregated_paired_per_repeat(pd: ModuleType) -> None:
    def run(repeat: int, itl: float, ttft: float, tokens: float, split: float = 0.0) -> object:
        figures = {"itl p90": itl, "rag ttft p90": ttft, "chat ttft p90": ttft, "split": split}
        return SimpleNamespace(
            repeat=repeat, pd=figures, ttft_p90=ttft, window_tokens_per_s=tokens, lost=0
        )

    pickers = {
        "lora-prefix": [run(0, 0.2, 1.0, 1000)],
        "pd": [run(0, 0.09, 1.1, 960, 0.3)],  # ITL 2.2x lower, TTFT 1.1x, 96%
        "pd split_at 0": [run(0, 0.1, 3.0, 900, 1.0)],
        "pd never": [run(0, 0.21, 1.0, 1000)],  # pd's TTFT is worse: not both <= 1
    }
    unloaded = [run(0, 0.08, 0.3, 10)]
    lines = pd.live_table(("rag", "6/s", 1.0), pickers, unloaded)
    goals = [line for line in lines if line.startswith("- ")]
    assert "2.50x" in goals[0] and goals[0].endswith("met")  # 0.2 / 0.08
    assert "2.22x" in goals[1] and goals[1].endswith("met")
    assert "1.10x" in goals[2] and goals[2].endswith("met")
    assert "96.0%" in goals[3] and goals[3].endswith("met")
    assert goals[4].startswith("- pd / pd split_at 0") and goals[4].endswith("met")
    assert goals[5].startswith("- pd / pd never") and goals[5].endswith("MISSED")
    assert any(line.startswith("| pd | 90 | 0.45 |") for line in lines)


@pytest.mark.e2e
async def test_a_live_pd_pool_splits_long_prompts_through_envoy(
    pd: ModuleType, live: ModuleType, tmp_path: Path
) -> None:
    """One prefill and five decode pods behind the real Envoy and ``policyd serve``: a
    RAG question's first prompt is split (its document is cached nowhere yet), its
    prefill runs on the prefill pod, and every streamed answer's token gaps arrive."""
    stack = sys.modules["live_stack"]
    setup = stack.Setup(
        BENCHMARKS.parent / "rules" / "pd.yaml", 10.0, "l4-llama3.1-8b", 100, 120.0,
        roles=pd.roles(1),
    )  # fmt: skip
    requests = RagMix(rag_share=1.0).requests(rate=2.0, duration_s=4.0, seed=5)
    assert requests
    async with stack.Stack(setup, tmp_path) as running:
        outcomes, _ = await stack.run_open(
            running.url, requests, base_model=pd.PROFILE.base_model, time_scale=10.0,
            timeout_s=120.0, streamed=[True] * len(requests), critical_default=True,
            exact_lengths=True,
        )  # fmt: skip
        (replica,) = running.replicas
        split = await pd.live_policyd_figures(replica.monitoring_port)
        async with aiohttp.ClientSession() as session:
            prefill_page = await stack._get_text(
                session, f"http://127.0.0.1:{running.pod_ports[0]}/metrics"
            )
    assert all(o.done is not None for o in outcomes), [o.answer for o in outcomes]
    for outcome, request in zip(outcomes, requests, strict=True):
        assert outcome.tokens == request.output_length  # the pod wrote the stated length
        assert len(outcome.gaps) == outcome.tokens - 1
    assert split["split"] > 0.0
    assert stack.metric_sum(prefill_page, "vllm:request_success_total") > 0
    figures = pd.live_figures(outcomes, 10.0)
    assert figures["itl p90"] > 0.0 and figures["rag ttft p90"] > 0.0
    assert math.isnan(figures["chat ttft p90"])  # no chat turns in this run
