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
"""

from __future__ import annotations

from typing import Final

DECAY: Final = 0.02  # each report's weight against the decayed sums: a memory of ~50 requests
PROMPT_SCALE_BOUNDS: Final = (0.25, 4.0)  # a report further off the rule counts as this far


class DecayedRatio:
    """A ratio of exponentially decayed sums; ``default`` until the first sample."""

    __slots__ = ("_denominator", "_numerator", "default")

    def __init__(self, default: float) -> None:
        self.default = default
        self._numerator = 0.0
        self._denominator = 0.0

    def add(self, numerator: float, denominator: float) -> None:
        keep = 1.0 - DECAY
        self._numerator = self._numerator * keep + numerator
        self._denominator = self._denominator * keep + denominator

    @property
    def value(self) -> float:
        if self._denominator <= 0.0:
            return self.default
        return self._numerator / self._denominator


class Footprint:
    """The KV-cache tokens a request holds on average, from its prompt estimate and
    budget, scaled by what the pods reported for earlier requests."""

    __slots__ = ("_budgeted", "_prompt", "_unbudgeted")

    def __init__(self) -> None:
        self._prompt = DecayedRatio(1.0)  # tokens counted by the pods per token estimated
        self._budgeted = DecayedRatio(1.0)  # tokens generated per token of max_tokens
        self._unbudgeted = DecayedRatio(0.0)  # tokens generated per request without a budget

    def tokens(self, prompt_estimate: int, max_tokens: int) -> int:
        """What the request holds on average over its life: its prompt, half its output."""
        prompt = max(0, prompt_estimate) * self._prompt.value
        output = max_tokens * self._budgeted.value if max_tokens > 0 else self._unbudgeted.value
        return round(prompt + output / 2)

    def learn(
        self, prompt_estimate: int, max_tokens: int, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """A pod reported ``prompt_tokens`` and ``completion_tokens`` for a request
        policyd estimated at ``prompt_estimate`` with a budget of ``max_tokens``."""
        if prompt_estimate > 0 and prompt_tokens > 0:
            low, high = PROMPT_SCALE_BOUNDS  # so one odd report moves the scale little
            counted = min(high * prompt_estimate, max(low * prompt_estimate, prompt_tokens))
            self._prompt.add(counted, prompt_estimate)
        if completion_tokens < 0:
            return
        if max_tokens > 0:
            self._budgeted.add(min(completion_tokens, max_tokens), max_tokens)
        else:
            self._unbudgeted.add(completion_tokens, 1)
