"""A policy reads ``pod.predicted_ttft_ms`` / ``pod.predicted_tpot_ms`` through the router:
the models are asked only for such a policy (TPOT per pod only for one that reads it), a
cold pod reads -1.0, and the decision carries the chosen pod's prediction; the learning
sink teaches the models from each exchange's end, streamed or not."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from policyd.latency.learning import Learning
from policyd.latency.model import WARM
from policyd.latency.models import COLD, LatencyModels, Loaded, Outcome
from policyd.policy import Router
from policyd.policy.decision import Outcome as Routed
from policyd.policy.loader import load_policy_set
from policyd.policy.request import Request
from policyd.pool.pod import Pod
from policyd.telemetry.exchange_end import ExchangeEnd

MEETS_SLO = """\
filters:
  meets the objective:
    keep: >-
      pod.predicted_ttft_ms >= 0.0 && pod.predicted_ttft_ms <= request.slo_ttft_ms
    on_failure: cold ones
  cold ones:
    keep: pod.predicted_ttft_ms < 0.0
"""
PLAIN = """\
filters:
  all:
    keep: pod.waiting_queue >= 0
"""
PODS = (Pod("slow", "10.0.0.1:8000"), Pod("fast", "10.0.0.2:8000"), Pod("new", "10.0.0.3:8000"))


def trained(models: LatencyModels | None = None) -> LatencyModels:
    """``models`` (new ones by default) taught "slow" (900 ms TTFT) and "fast" (120 ms)."""
    models = LatencyModels() if models is None else models
    for _ in range(WARM + 10):
        models.learn(Outcome(PODS[0], 0, 0, 500, 800, 900.0, 40.0))
        models.learn(Outcome(PODS[1], 0, 0, 500, 800, 120.0, 20.0))
    return models


def router(tmp_path: Path, text: str, models: LatencyModels) -> Router:
    (tmp_path / "p.yaml").write_text(text)
    return Router(load_policy_set(tmp_path / "p.yaml"), rng=random.Random(0), latency=models)


def test_a_policy_keeps_the_pods_predicted_to_meet_the_objective(tmp_path: Path) -> None:
    decide = router(tmp_path, MEETS_SLO, trained()).decide
    # Its context (prompt and half the budget) is the one the models learned on.
    request = Request(model="m", prompt_tokens=500, max_tokens=600, slo_ttft_ms=300.0)
    decision = decide(request, PODS)
    assert decision.pod == "fast"
    assert decision.predicted is not None
    ttft, tpot = decision.predicted
    assert abs(ttft - 120.0) < 5.0 and abs(tpot - 20.0) < 2.0
    # No warm pod meets 50 ms: the policy falls back to the pod without a prediction.
    cold = decide(Request(model="m", prompt_tokens=500, slo_ttft_ms=50.0), PODS)
    assert cold.pod == "new" and cold.predicted == (COLD, COLD)


def test_a_policy_that_does_not_read_predictions_gets_none(tmp_path: Path) -> None:
    decision = router(tmp_path, PLAIN, trained()).decide(Request(model="m"), PODS)
    assert decision.outcome is Routed.ROUTED and decision.predicted is None
    # Without models the fields read their "no prediction" value.
    decision = router(tmp_path, MEETS_SLO, LatencyModels()).decide(
        Request(model="m", slo_ttft_ms=300.0), PODS
    )
    assert decision.predicted == (COLD, COLD)


class Counting(LatencyModels):
    """The models, counting the pods each kind of prediction is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: dict[str, list[str]] = {"ttft": [], "tpot": []}

    def predict_ttft(self, pods: Sequence[Loaded], uncached_tokens: Sequence[int]) -> list[float]:
        self.asked["ttft"] += [pod.name for pod in pods]
        return super().predict_ttft(pods, uncached_tokens)

    def predict_tpot(self, pods: Sequence[Loaded], context_tokens: int) -> list[float]:
        self.asked["tpot"] += [pod.name for pod in pods]
        return super().predict_tpot(pods, context_tokens)


def test_tpot_is_predicted_per_pod_only_for_a_policy_that_reads_it(tmp_path: Path) -> None:
    models = Counting()
    trained(models)
    request = Request(model="m", prompt_tokens=500, max_tokens=600, slo_ttft_ms=300.0)
    decision = router(tmp_path, MEETS_SLO, models).decide(request, PODS)
    assert models.asked == {"ttft": ["slow", "fast", "new"], "tpot": ["fast"]}
    # The decision (its span, the prediction error metric) still carries the chosen pod's.
    assert decision.pod == "fast" and decision.predicted is not None
    assert abs(decision.predicted[1] - 20.0) < 2.0
    reads_tpot = MEETS_SLO + "score:\n  quick tokens:\n    expr: -pod.predicted_tpot_ms\n"
    models.asked = {"ttft": [], "tpot": []}
    again = router(tmp_path, reads_tpot, models).decide(request, PODS)
    assert models.asked == {"ttft": ["slow", "fast", "new"], "tpot": ["slow", "fast", "new"]}
    assert again.predicted == decision.predicted


def learn_exchanges(tmp_path: Path, *, stream: bool, count: int) -> LatencyModels:
    """``count`` exchanges on ``fast``: 200 ms to the first token, then 30 ms a token."""
    models = LatencyModels()
    decide = router(tmp_path, PLAIN, models).decide
    sink = Learning(models)
    for _ in range(count):
        request = Request(model="m", prompt_tokens=400, stream=stream)
        decision = decide(request, PODS[1:2])
        span = sink.start(request, decision, {}, 0.0001)
        tokens = 101
        span.end(ExchangeEnd(True, 0.2 + 0.03 * (tokens - 1), 0.2 if stream else 3.2, 400, tokens))
    return models


def test_streamed_answers_teach_ttft_and_tpot(tmp_path: Path) -> None:
    models = learn_exchanges(tmp_path, stream=True, count=WARM + 4)
    ttft, tpot = models.predict_ttft(PODS[1:2], (400,))[0], models.predict_tpot(PODS[1:2], 450)[0]
    assert abs(ttft - 200.0) < 5.0 and abs(tpot - 30.0) < 1.0


def test_non_streamed_answers_teach_ttft_once_tpot_is_known(tmp_path: Path) -> None:
    only_whole = learn_exchanges(tmp_path, stream=False, count=WARM + 4)
    assert only_whole.fits["fast"].tpot.samples == 0  # a whole answer hides its pace
    assert only_whole.fits["fast"].ttft.samples == 0  # so its TTFT cannot be told yet
    models = learn_exchanges(tmp_path, stream=True, count=WARM + 4)
    sink = Learning(models)
    decide = router(tmp_path, PLAIN, models).decide
    for _ in range(40):
        request = Request(model="m", prompt_tokens=400)
        span = sink.start(request, decide(request, PODS[1:2]), {}, 0.0001)
        span.end(ExchangeEnd(True, 0.5 + 0.03 * 100, 0.5 + 0.03 * 100, 400, 101))
    ttft = models.predict_ttft(PODS[1:2], (400,))[0]
    assert 300.0 < ttft < 520.0  # moved from 200 ms towards the 500 ms the whole answers say


def test_an_unfinished_or_unrouted_exchange_teaches_nothing(tmp_path: Path) -> None:
    models = LatencyModels()
    decide = router(tmp_path, PLAIN, models).decide
    sink = Learning(models)
    request = Request(model="m", prompt_tokens=400, stream=True)
    sink.start(request, decide(request, PODS), {}, 0.0).end(ExchangeEnd(False, 1.0, 0.2, 1, 5))
    sink.start(request, decide(request, ()), {}, 0.0).end(ExchangeEnd(True, 1.0, 0.2, 1, 5))
    sink.start(request, decide(request, PODS), {}, 0.0).end(ExchangeEnd(True, 1.0, 0.2, 1, None))
    assert dict(models.fits) == {}


def test_the_documented_example_routes_as_the_documentation_says(tmp_path: Path) -> None:
    text = (Path(__file__).parents[2] / "docs" / "policy-language.md").read_text()
    start = text.index("name: slo-example")
    example = text[start : text.index("```", start)]
    decide = router(tmp_path, example, trained()).decide
    # Under 500 ms only "fast" (120 ms) is predicted to make it.
    assert decide(Request(model="m", prompt_tokens=500, slo_ttft_ms=500.0), PODS).pod == "fast"
    # Nobody is predicted under 50 ms: everyone is in play, the quickest first.
    assert decide(Request(model="m", prompt_tokens=500, slo_ttft_ms=50.0), PODS).pod == "fast"
    # A cold pod scores as one predicted at 500 ms: ahead of the slow one (900 ms).
    assert decide(Request(model="m", prompt_tokens=500), (PODS[0], PODS[2])).pod == "new"


def test_nothing_is_learned_while_no_policy_in_force_reads_predictions(tmp_path: Path) -> None:
    models = LatencyModels()
    decide = router(tmp_path, PLAIN, models).decide
    reading = [False]
    sink = Learning(models, lambda: reading[0])
    request = Request(model="m", prompt_tokens=400, stream=True)
    end = ExchangeEnd(True, 1.0, 0.2, 400, 5)
    sink.start(request, decide(request, PODS[1:2]), {}, 0.0).end(end)
    assert dict(models.fits) == {}
    reading[0] = True
    sink.start(request, decide(request, PODS[1:2]), {}, 0.0).end(end)
    assert models.fits["fast"].ttft.samples == 1
