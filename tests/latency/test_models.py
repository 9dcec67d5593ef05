"""The latency models learn a pod's TTFT and TPOT from outcomes, say "cold" until they
have enough, start again for a pod that restarted or changed model, and shrug off
nonsense."""

from __future__ import annotations

import random
from collections.abc import Sequence

from policyd.latency.model import WARM, Learner
from policyd.latency.models import COLD, MAX_PODS, LatencyModels, Outcome
from policyd.policy.pods import StaticPod


def predict(
    models: LatencyModels, pods: Sequence[StaticPod], uncached: Sequence[int], context: int
) -> list[tuple[float, float]]:
    """Each pod's (TTFT, TPOT) prediction, as a policy reading both gets them."""
    ttfts = models.predict_ttft(pods, uncached)
    return list(zip(ttfts, models.predict_tpot(pods, context), strict=True))


def ttft_truth(uncached: int, waiting: int, in_flight: int, queued: int) -> float:
    # The prefill queued ahead weighs as the request's own: the pod prefills it first.
    return 40.0 + 0.12 * uncached + 90.0 * waiting + 15.0 * in_flight + 0.12 * queued


def tpot_truth(running: int, context: int) -> float:
    return 12.0 + 0.8 * running + 0.002 * context


def outcome(pod: StaticPod, rng: random.Random, noise: float = 0.0) -> Outcome:
    uncached = rng.randrange(50, 3000)
    context = uncached + rng.randrange(0, 2000)
    in_flight = pod.in_flight
    wobble = 1.0 + rng.uniform(-noise, noise)
    queued = pod.queued_prefill_tokens
    return Outcome(
        pod,
        in_flight,
        queued,
        uncached,
        context,
        ttft_truth(uncached, pod.waiting_queue, in_flight, queued) * wobble,
        tpot_truth(pod.running, context) * wobble,
    )


def loaded(name: str, rng: random.Random, address: str = "", model: str = "") -> StaticPod:
    return StaticPod(
        name,
        address or f"{name}:8000",
        waiting_queue=rng.randrange(0, 10),
        running=rng.randrange(0, 40),
        kv_cache=rng.random(),
        in_flight=rng.randrange(0, 12),
        queued_prefill_tokens=rng.randrange(0, 6000),
        base_model=model,
    )


def test_a_pod_is_cold_until_it_has_learned_enough() -> None:
    rng = random.Random(1)
    models = LatencyModels()
    pod = loaded("a", rng)
    assert predict(models, (pod,), (500,), 800) == [(COLD, COLD)]
    for _ in range(WARM - 1):
        models.learn(outcome(loaded("a", rng), rng))
    assert predict(models, (pod,), (500,), 800) == [(COLD, COLD)]
    models.learn(outcome(loaded("a", rng), rng))
    ttft, tpot = predict(models, (pod,), (500,), 800)[0]
    assert ttft > 0.0 and tpot > 0.0


def test_the_models_learn_ttft_and_tpot_online() -> None:
    rng = random.Random(2)
    models = LatencyModels()
    for _ in range(400):
        models.learn(outcome(loaded("a", rng), rng, noise=0.05))
    errors_ttft, errors_tpot = [], []
    for _ in range(100):
        pod = loaded("a", rng)
        uncached, context = rng.randrange(50, 3000), rng.randrange(500, 5000)
        ttft, tpot = predict(models, (pod,), (uncached,), context)[0]
        true_ttft = ttft_truth(
            uncached, pod.waiting_queue, pod.in_flight, pod.queued_prefill_tokens
        )
        errors_ttft.append(abs(ttft - true_ttft) / true_ttft)
        errors_tpot.append(abs(tpot - tpot_truth(pod.running, context)) / tpot)
    assert sorted(errors_ttft)[50] < 0.05
    assert sorted(errors_tpot)[50] < 0.05


def test_each_pod_has_its_own_model() -> None:
    rng = random.Random(3)
    models = LatencyModels()
    for _ in range(200):
        models.learn(outcome(loaded("slow", rng), rng))
        fast = loaded("fast", rng)
        models.learn(Outcome(fast, fast.in_flight, 0, 100, 100, 20.0, 5.0))
    pods = (StaticPod("slow", "slow:8000", waiting_queue=5), StaticPod("fast", "fast:8000"))
    (slow_ttft, _), (fast_ttft, fast_tpot) = predict(models, pods, (1000, 1000), 1000)
    assert slow_ttft > 400.0
    assert abs(fast_ttft - 20.0) < 2.0 and abs(fast_tpot - 5.0) < 0.5


def test_a_pod_that_restarted_or_changed_model_starts_cold_and_learns_again() -> None:
    rng = random.Random(4)
    for changed in (
        {"address": "10.0.0.9:8000", "model": "m"},  # restarted: a new address
        {"address": "a:8000", "model": "other"},  # now serves another model
    ):
        models = LatencyModels()
        for _ in range(50):
            models.learn(outcome(loaded("a", rng, "a:8000", "m"), rng))
        assert predict(models, (loaded("a", rng, "a:8000", "m"),), (10,), 10)[0][0] > 0
        again = loaded("a", rng, changed["address"], changed["model"])
        assert predict(models, (again,), (10,), 10) == [(COLD, COLD)]
        models.learn(outcome(again, rng))
        # The old pod's fit is gone, not merely hidden: its first outcome starts anew.
        assert models.fits["a"].ttft.samples == 1


def test_nonsense_outcomes_teach_nothing() -> None:
    learner = Learner(2)
    for value in (0.0, -3.0, float("nan"), float("inf")):
        learner.learn((1.0, 2.0), value)
    learner.learn((1.0, float("inf")), 5.0)
    learner.learn((1.0,), 5.0)  # the wrong width
    assert learner.fit.samples == 0
    assert learner.fit.coefficients == (0.0, 0.0)


def test_the_models_of_churning_pods_stay_bounded() -> None:
    models = LatencyModels()
    rng = random.Random(5)
    for i in range(MAX_PODS + 3):
        pod = StaticPod(f"p{i}", f"p{i}:8000")
        models.learn(Outcome(pod, 0, 0, 10, 10, rng.uniform(5, 9), 1.0))
    assert len(models.fits) == MAX_PODS
    assert "p0" not in models.fits and f"p{MAX_PODS + 2}" in models.fits


def test_a_reader_keeps_the_fits_it_read_while_the_models_learn() -> None:
    rng = random.Random(6)
    models = LatencyModels()
    models.learn(outcome(loaded("a", rng), rng))
    seen = models.fits
    before = dict(seen)
    for _ in range(20):
        models.learn(outcome(loaded("a", rng), rng))
    assert dict(seen) == before and models.fits is not seen


def test_the_prefill_queued_ahead_raises_the_predicted_ttft() -> None:
    """Two pods alike but for the prefill policyd queued there: the one with more
    waits longer, by what the model learned a queued token costs."""
    rng = random.Random(7)
    models = LatencyModels()
    for _ in range(400):
        models.learn(outcome(loaded("a", rng), rng, noise=0.05))
    idle = StaticPod("a", "a:8000", waiting_queue=2, running=10, in_flight=3)
    behind = StaticPod(
        "a", "a:8000", waiting_queue=2, running=10, in_flight=3, queued_prefill_tokens=4000
    )
    (ttft_idle, tpot_idle), (ttft_behind, tpot_behind) = predict(
        models, (idle, behind), (200, 200), 800
    )
    assert abs((ttft_behind - ttft_idle) - 0.12 * 4000) < 0.1 * 0.12 * 4000
    assert tpot_behind == tpot_idle
