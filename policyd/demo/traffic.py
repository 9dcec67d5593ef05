"""The demo's clients: OpenAI requests through Envoy, arriving at a steady rate.

Requests arrive open-loop (Poisson, ``rate`` per second, at most
``max_in_flight`` open at once), so the pool sees the overlapping traffic a
real gateway does. What they ask for depends on the workload:

- ``lora``: short prompts naming the LoRA adapters with a skewed popularity
  (a few adapters are hot, as in production) or the base model;
- ``shared-prefix``: the base model only, every request from one of a handful
  of groups (applications) whose requests all start with the group's long
  system prompt, then a short question of their own, as chat, agent and RAG
  traffic does; a group's application uses chat or completions;
- ``mixed`` (the default): both at once, each request a group's prompt sent
  to an adapter (or the base model) of skewed popularity.

A share is streamed (with ``stream_options.include_usage``, so usage is
reported), a share is marked critical with the criticality header the
shipped policies read; in ``lora`` a share is chat. Each request carries
``x-demo-request: rNNN`` so the table can name it.

Request ``i`` is drawn from its own generator seeded with the plan's seed
and ``i``, the arrival gaps from another: the same plan sends the same
requests in the same order, whatever the timing, which is what lets the
demo replay a run under another policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import aiohttp

from policyd.demo.feed import LABEL_HEADER

Workload = Literal["mixed", "shared-prefix", "lora"]
WORKLOADS: Final[tuple[Workload, ...]] = ("mixed", "shared-prefix", "lora")
CRITICALITY_HEADER: Final = "x-gateway-inference-criticality"
_WORDS: Final = (
    *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while"),
    *("the", "model", "writes", "SQL", "for", "an", "analyst", "summarising"),
    *("quarterly", "revenue", "by", "region", "and", "product", "line"),
)
_INSTRUCTION_WORDS: Final = (
    *("always", "never", "answer", "politely", "cite", "the", "policy", "document"),
    *("customer", "account", "refund", "invoice", "contract", "clause", "when", "if"),
    *("unsure", "ask", "escalate", "to", "a", "human", "agent", "keep", "replies"),
    *("short", "use", "tables", "for", "figures", "and", "dates", "in", "ISO", "format"),
    *("do", "not", "reveal", "internal", "notes", "tools", "search", "knowledge", "base"),
)
_TEAMS: Final = (
    *("billing", "search", "legal", "support", "finance", "research", "travel"),
    *("security", "sales", "payroll", "logistics", "design"),
)
SENTENCE_WORDS: Final = 12


@dataclass(frozen=True, slots=True)
class TrafficPlan:
    """What to send; ``requests`` None sends until stopped."""

    adapters: tuple[str, ...]  # in popularity order
    base_model: str
    workload: Workload = "mixed"
    requests: int | None = 200
    rate: float = 12.0
    max_in_flight: int = 48
    stream_share: float = 0.3
    chat_share: float = 0.3  # lora only; a group's application uses one API
    critical_share: float = 0.3
    max_tokens: tuple[int, int] = (48, 256)
    groups: int = 6
    # Words of the shortest and the longest system prompt, spread evenly over
    # the groups: 300 to 1,000 words are 20 to 70 KV blocks of 16 tokens. The
    # six groups' prompts for one model (about 260 blocks) fit in a simulated
    # pod's 700 with room for the running requests, but not for every adapter
    # (keys are seeded with the adapter): where a prompt goes matters.
    system_words: tuple[int, int] = (300, 1000)
    seed: int = 0

    @property
    def models(self) -> tuple[str, ...]:
        """The models requests name: adapters first, in popularity order, base model last."""
        if self.workload == "shared-prefix":
            return (self.base_model,)
        return (*self.adapters, self.base_model)

    @property
    def shares_prefixes(self) -> bool:
        return self.workload != "lora"


@dataclass(frozen=True, slots=True)
class Group:
    """Users of one application: its system prompt, sent with every request, and its API."""

    name: str
    system_prompt: str
    chat: bool


@dataclass
class TrafficResults:
    """What the clients saw (the table shows what policyd saw)."""

    sent: int = 0
    finished: int = 0
    completed: int = 0  # answered 200 and read to the end
    statuses: Counter[int] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)  # no HTTP answer: why

    @property
    def in_flight(self) -> int:
        return self.sent - self.finished


def popularity(count: int) -> list[float]:
    """Zipf-like weights: the first adapters are hot, the last ones rare."""
    return [1.0 / (rank + 1) ** 0.9 for rank in range(count)]


def groups(plan: TrafficPlan) -> tuple[Group, ...]:
    """The plan's groups: each system prompt differs from the first sentence on.

    Group ``g``'s prompt has its share of ``system_words`` (the first group the
    fewest, the last the most), in sentences of instructions; every third
    group's application speaks chat, the others completions.
    """
    shortest, longest = plan.system_words
    step = (longest - shortest) / max(1, plan.groups - 1)
    rng = random.Random(f"demo-groups/{plan.seed}")
    found: list[Group] = []
    for g in range(plan.groups):
        team = _TEAMS[g % len(_TEAMS)] + ("" if g < len(_TEAMS) else f"-{g // len(_TEAMS)}")
        words = rng.choices(_INSTRUCTION_WORDS, k=round(shortest + g * step))
        sentences = (
            " ".join(words[i : i + SENTENCE_WORDS]).capitalize() + "."
            for i in range(0, len(words), SENTENCE_WORDS)
        )
        prompt = f"You are the assistant of the {team} team. " + " ".join(sentences)
        found.append(Group(team, prompt, chat=g % 3 == 0))
    return tuple(found)


def request_of(
    plan: TrafficPlan, index: int, shared: tuple[Group, ...]
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """Path, body and headers of request ``index`` of ``plan`` (``shared``: its groups)."""
    rng = random.Random(f"demo-request/{plan.seed}/{index}")
    models = plan.models
    model = rng.choices(models, popularity(len(models)))[0]
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(*plan.max_tokens)}
    if plan.shares_prefixes:
        group = rng.choice(shared)
        question = " ".join(rng.choices(_WORDS, k=rng.randint(8, 30))) + "?"
        chat = group.chat
        messages = [
            {"role": "system", "content": group.system_prompt},
            {"role": "user", "content": question},
        ]
        prompt = f"{group.system_prompt}\n\nQuestion: {question}\nAnswer:"
    else:
        words = " ".join(rng.choices(_WORDS, k=rng.randint(12, 60)))
        chat = rng.random() < plan.chat_share
        messages = [{"role": "user", "content": words}]
        prompt = words
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = messages
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    if rng.random() < plan.stream_share:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    headers = {LABEL_HEADER: f"r{index + 1:03d}"}
    if rng.random() < plan.critical_share:
        headers[CRITICALITY_HEADER] = "critical"
    return path, body, headers


class Traffic:
    def __init__(self, url: str, plan: TrafficPlan) -> None:
        self.url = url
        self.plan = plan
        self.results = TrafficResults()
        self._arrivals = random.Random(f"demo-arrivals/{plan.seed}")
        self._groups = groups(plan) if plan.shares_prefixes else ()

    def request(self, index: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        """Path, body and headers of request ``index``."""
        return request_of(self.plan, index, self._groups)

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
                    task = asyncio.create_task(self._one(session, *self.request(index)))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    task.add_done_callback(lambda _: slots.release())
                    index += 1
                    with contextlib.suppress(TimeoutError):
                        gap = self._arrivals.expovariate(plan.rate)
                        await asyncio.wait_for(stopping.wait(), gap)
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

    async def _one(
        self,
        session: aiohttp.ClientSession,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> None:
        results = self.results
        results.sent += 1
        try:
            async with session.post(self.url + path, json=body, headers=headers) as response:
                async for _ in response.content.iter_any():
                    pass  # read a stream as it comes, like a chat client
                results.statuses[response.status] += 1
                if response.status == 200:
                    results.completed += 1
        except aiohttp.ClientError as error:
            results.failures[type(error).__name__] += 1
        finally:
            results.finished += 1
