"""The demo's clients: OpenAI requests through Envoy, arriving at a steady rate.

Requests arrive open-loop (Poisson, ``rate`` per second, at most
``max_in_flight`` open at once), so the pool sees the overlapping traffic a
real gateway does. They name the LoRA adapters with a skewed popularity (a
few adapters are hot, as in production), some the base model; a share is
streamed (with ``stream_options.include_usage``, so usage is reported), a
share is chat, a share is marked critical with the criticality header the
shipped policies read. Each carries ``x-demo-request: rNNN`` so the table can
name it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

from policyd.demo.feed import LABEL_HEADER

CRITICALITY_HEADER: Final = "x-gateway-inference-criticality"
_WORDS: Final = (
    *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while"),
    *("the", "model", "writes", "SQL", "for", "an", "analyst", "summarising"),
    *("quarterly", "revenue", "by", "region", "and", "product", "line"),
)


@dataclass(frozen=True, slots=True)
class TrafficPlan:
    """What to send; ``requests`` None sends until stopped."""

    models: tuple[str, ...]  # adapters first (in popularity order), the base model last
    requests: int | None = 200
    rate: float = 12.0
    max_in_flight: int = 48
    stream_share: float = 0.3
    chat_share: float = 0.3
    critical_share: float = 0.3
    max_tokens: tuple[int, int] = (48, 256)
    seed: int = 0


@dataclass
class TrafficResults:
    """What the clients saw (the table shows what policyd saw)."""

    sent: int = 0
    finished: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)  # no HTTP answer: why

    @property
    def in_flight(self) -> int:
        return self.sent - self.finished


def popularity(count: int) -> list[float]:
    """Zipf-like weights: the first adapters are hot, the last ones rare."""
    return [1.0 / (rank + 1) ** 0.9 for rank in range(count)]


class Traffic:
    def __init__(self, url: str, plan: TrafficPlan) -> None:
        self.url = url
        self.plan = plan
        self.results = TrafficResults()
        self._rng = random.Random(plan.seed)
        self._weights = popularity(len(plan.models))

    async def run(self, stopping: asyncio.Event) -> None:
        """Send the plan's requests (or until ``stopping``), then wait for the answers."""
        plan = self.plan
        slots = asyncio.Semaphore(plan.max_in_flight)
        pending: set[asyncio.Task[None]] = set()
        timeout = aiohttp.ClientTimeout(total=300)
        connector = aiohttp.TCPConnector(limit=plan.max_in_flight)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            try:
                index = 0
                while (plan.requests is None or index < plan.requests) and not stopping.is_set():
                    await slots.acquire()
                    task = asyncio.create_task(self._one(session, index))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    task.add_done_callback(lambda _: slots.release())
                    index += 1
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), self._rng.expovariate(plan.rate))
                answers: asyncio.Future[Any] = asyncio.gather(*pending, return_exceptions=True)
                stopped: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
                try:
                    await asyncio.wait({answers, stopped}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stopped.cancel()
            finally:
                for task in list(pending):
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    def request(self, index: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        """Path, body and headers of request ``index`` (drawn from the plan's generator)."""
        plan, rng = self.plan, self._rng
        model = rng.choices(plan.models, self._weights)[0]
        words = " ".join(rng.choices(_WORDS, k=rng.randint(12, 60)))
        body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(*plan.max_tokens)}
        if rng.random() < plan.chat_share:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": words}]
        else:
            path = "/v1/completions"
            body["prompt"] = words
        if rng.random() < plan.stream_share:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        headers = {LABEL_HEADER: f"r{index + 1:03d}"}
        if rng.random() < plan.critical_share:
            headers[CRITICALITY_HEADER] = "critical"
        return path, body, headers

    async def _one(self, session: aiohttp.ClientSession, index: int) -> None:
        path, body, headers = self.request(index)
        results = self.results
        results.sent += 1
        try:
            async with session.post(self.url + path, json=body, headers=headers) as response:
                async for _ in response.content.iter_any():
                    pass  # read a stream as it comes, like a chat client
                results.statuses[response.status] += 1
        except aiohttp.ClientError as error:
            results.failures[type(error).__name__] += 1
        finally:
            results.finished += 1
