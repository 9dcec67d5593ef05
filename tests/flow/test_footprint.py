"""Footprint: what a request holds in a pod's KV cache, learned from reported usage."""

from __future__ import annotations

from policyd.flow.footprint import DECAY, MAX_COUNTED, OUTLIER, PROMPT_SCALE_BOUNDS, Footprint


def test_until_a_pod_reports_the_guess_stands() -> None:
    """Prompt as estimated plus half the budget; nothing for an unbudgeted output."""
    footprint = Footprint()
    assert footprint.tokens(300, 200) == 400
    assert footprint.tokens(300, 0) == 300


def test_the_prompt_scale_follows_the_model_tokenizer() -> None:
    """The pods count 0.7 of policyd's estimate: a prompt then costs 0.7 of it."""
    footprint = Footprint()
    for _ in range(20):
        footprint.learn(400, 100, 280, 100)
    assert footprint.tokens(1000, 0) == 700
    assert footprint.tokens(1000, 100) == 750


def test_a_budget_counts_the_share_of_it_clients_get() -> None:
    """Clients ask for 1,000 tokens and get 250: an output costs 125 on average."""
    footprint = Footprint()
    for _ in range(10):
        footprint.learn(100, 1000, 100, 250)
    assert footprint.tokens(0, 1000) == 125
    assert footprint.tokens(0, 400) == 50


def test_requests_without_a_budget_count_their_mean_output() -> None:
    footprint = Footprint()
    for completion in (100, 300):
        footprint.learn(100, 0, 100, completion)
    assert 190 <= footprint.tokens(0, 0) * 2 <= 210


def test_the_scales_follow_a_change_of_traffic() -> None:
    """Decayed sums: after a change the newer reports dominate within a few hundred."""
    footprint = Footprint()
    for _ in range(200):
        footprint.learn(100, 100, 50, 100)
    assert footprint.tokens(1000, 0) == 500
    for _ in range(300):
        footprint.learn(100, 100, 150, 100)
    assert 1450 <= footprint.tokens(1000, 0) <= 1500


def test_one_odd_report_moves_the_estimate_little() -> None:
    footprint = Footprint()
    for _ in range(100):
        footprint.learn(100, 100, 100, 100)
    footprint.learn(100, 100, 10_000, 100)
    assert footprint.tokens(1000, 0) < 1100


def test_the_prompt_scale_is_bounded_and_empty_reports_teach_nothing() -> None:
    footprint = Footprint()
    footprint.learn(0, 0, 500, -1)  # no estimate, no completion count: nothing to learn
    assert footprint.tokens(100, 0) == 100
    for _ in range(50):
        footprint.learn(10, 10, 10_000, 10)
    assert footprint.tokens(100, 0) == 100 * PROMPT_SCALE_BOUNDS[1]


def test_any_count_is_read_as_a_bounded_number_of_tokens() -> None:
    """10**400, 1e300, NaN or negative counts neither raise nor give more than a
    full cache's worth: a count is read as 0 to MAX_COUNTED tokens."""
    footprint = Footprint()
    for value in (10**400, int(1e300), 1e300, float("inf")):
        assert footprint.tokens(0, value) == MAX_COUNTED // 2  # type: ignore[arg-type]
        assert footprint.tokens(value, 0) == MAX_COUNTED  # type: ignore[arg-type]
        footprint.learn(value, value, value, value)  # type: ignore[arg-type]
    assert footprint.tokens(float("nan"), -5) == 0  # type: ignore[arg-type]


def test_one_huge_report_weighs_as_a_few_average_ones() -> None:
    """A budget of 10**400 that brought 100 tokens says the budgets bring nothing;
    it weighs as OUTLIER average budgets, not as 10**398 of them."""
    footprint = Footprint()
    for _ in range(100):
        footprint.learn(100, 200, 100, 100)  # budgets bring half
    assert footprint.tokens(0, 200) == 50
    footprint.learn(100, 10**400, 100, 100)
    share = footprint.tokens(0, 200) / 50
    assert 1 - OUTLIER * DECAY * 1.1 < share < 1  # moved, by about its bounded weight
