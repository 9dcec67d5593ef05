"""What a request holds in a pod's KV cache, learned from the usage pods report.

Flow control paces dispatch by an estimate of each pod's KV cache
(``control.py``): every request in flight there counts its prompt plus half
its output, what it holds on average over its life. Both parts start as
guesses. policyd counts a prompt by the four-characters rule, which a model's
tokenizer does not follow (for the simulated pods it counts ~30% high), and a
client's ``max_tokens`` is an upper bound it often does not reach. An
estimate too high keeps the pods below their capacity and the pool loses
throughput; too low, it overfills them and held requests wait in the pods
instead of the gateway.

A pod's answer reports what it really counted (``usage``: prompt and
completion tokens), and ``Footprint`` learns from it: the ratio of the tokens
the pods counted to policyd's prompt estimates, the ratio of the tokens
generated to the budgets asked for, and the mean output of requests that ask
for no budget. Each is a ratio of exponentially decayed sums, so it follows a
change of traffic within a few dozen requests and one odd request moves it
little. Until a pod reports, the estimate is the guess.

Every count here comes from a client (``max_tokens``, the prompt) or a pod
(``usage``), so none is trusted as a number: each is read as at most
``MAX_COUNTED`` tokens (a request counted so already fills any pod's cache),
and a sample weighs in a learned value at most ``OUTLIER`` times the decayed
mean sample (taken as at least ``SCALE`` tokens, so a mean near 0 can still
grow). One request with a budget of 10**400 or 1e300 then costs its pod a
full cache while it runs, and moves the learned ratios and the mean of the
estimates (the reserve, ``flight.py``) as a 4-times-average request would: it
cannot raise, and it cannot poison the estimates of the requests after it,
while a real change of traffic still takes over within a few dozen requests.
"""

from __future__ import annotations

from typing import Final

DECAY: Final = 0.02  # each report's weight against the decayed sums: a memory of ~50 requests
PROMPT_SCALE_BOUNDS: Final = (0.25, 4.0)  # a report further off the rule counts as this far
MAX_COUNTED: Final = 1 << 20  # tokens: the most any one count is read as
OUTLIER: Final = 4.0  # a sample weighs at most this many times the decayed mean sample
SCALE: Final = 64.0  # tokens: the least mean sample the bound assumes


def counted(value: float) -> float:
    """``value`` as a count of tokens: 0 to ``MAX_COUNTED`` (NaN and negatives read 0)."""
    if not value > 0:  # NaN as well
        return 0.0
    return float(min(value, MAX_COUNTED))  # compared as given: 10**400 never becomes a float


class DecayedRatio:
    """A ratio of exponentially decayed sums; ``default`` until the first sample.

    A sample's weight (its denominator) counts at most ``OUTLIER`` times the
    decayed mean weight, its numerator scaled alike: one huge sample keeps its
    ratio but not the say of many.
    """

    __slots__ = ("_count", "_denominator", "_numerator", "default")

    def __init__(self, default: float) -> None:
        self.default = default
        self._numerator = 0.0
        self._denominator = 0.0
        self._count = 0.0  # decayed number of samples

    def add(self, numerator: float, denominator: float) -> None:
        most = OUTLIER * max(SCALE, self._denominator / self._count if self._count else 0.0)
        if denominator > most:
            numerator *= most / denominator
            denominator = most
        keep = 1.0 - DECAY
        self._numerator = self._numerator * keep + numerator
        self._denominator = self._denominator * keep + denominator
        self._count = self._count * keep + 1.0

    @property
    def value(self) -> float:
        if self._denominator <= 0.0:
            return self.default
        return self._numerator / self._denominator


class DecayedMean:
    """A mean of exponentially decayed samples; ``default`` until the first. A sample
    counts at most ``OUTLIER`` times the mean (``SCALE`` while it is below)."""

    __slots__ = ("_count", "_total", "default")

    def __init__(self, default: float) -> None:
        self.default = default
        self._total = 0.0
        self._count = 0.0

    def add(self, sample: float) -> None:
        sample = min(
            sample, OUTLIER * max(SCALE, self._total / self._count if self._count else 0.0)
        )
        keep = 1.0 - DECAY
        self._total = self._total * keep + sample
        self._count = self._count * keep + 1.0

    @property
    def value(self) -> float:
        return self._total / self._count if self._count else self.default


class Footprint:
    """The KV-cache tokens a request holds on average, from its prompt estimate and
    budget, scaled by what the pods reported for earlier requests."""

    __slots__ = ("_budgeted", "_prompt", "_unbudgeted")

    def __init__(self) -> None:
        self._prompt = DecayedRatio(1.0)  # tokens counted by the pods per token estimated
        self._budgeted = DecayedRatio(1.0)  # tokens generated per token of max_tokens
        self._unbudgeted = DecayedMean(0.0)  # tokens generated per request without a budget

    def tokens(self, prompt_estimate: int, max_tokens: int) -> int:
        """What the request holds on average over its life: its prompt, half its output."""
        prompt = counted(prompt_estimate) * self._prompt.value
        budget = counted(max_tokens)
        output = budget * self._budgeted.value if budget else self._unbudgeted.value
        return round(prompt + output / 2)

    def learn(
        self, prompt_estimate: int, max_tokens: int, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """A pod reported ``prompt_tokens`` and ``completion_tokens`` for a request
        policyd estimated at ``prompt_estimate`` with a budget of ``max_tokens``."""
        estimate, budget = counted(prompt_estimate), counted(max_tokens)
        reported = counted(prompt_tokens)
        if estimate and reported:
            low, high = PROMPT_SCALE_BOUNDS  # so one odd report moves the scale little
            self._prompt.add(min(high * estimate, max(low * estimate, reported)), estimate)
        if not completion_tokens >= 0:  # the pod did not count it (NaN included)
            return
        completion = counted(completion_tokens)
        if budget:
            self._budgeted.add(min(completion, budget), budget)
        else:
            self._unbudgeted.add(completion)
