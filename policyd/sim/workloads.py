"""Open-loop workloads for prefix-cache routing: shared system prompts, chat sessions, LoRA.

Every prompt is real text (English words and full stops) tokenized by
``policyd.sim.tokenizer`` as the simulated HTTP front tokenizes a chat
request, so a router tokenizing the same turns with the simulator's tokenizer
(``policyd.prefix``'s ``sim`` tokenizer) computes exactly the ids, and the
block hashes, the pods cache. Arrivals are Poisson at ``rate`` requests per
second over ``duration_s`` seconds; everything is drawn from generators seeded
with the workload's seed, so two routers face the same requests.

The shapes, and why they fit the simulated pod (``l4-llama2-7b``: 700 KV
blocks of 16 tokens, 11,200 tokens per pod, 67,200 in a pool of 6):

- ``SharedPrefix``: groups of users, each group sharing one long system
  prompt, each user asking their own question. The published benchmarks use
  32 groups of 2,048-token system prompts and 256-token questions with 256
  output tokens (inference-perf's ``shared_prefix`` data, as llm-d's
  benchmark configurations set it) on GPUs of 80 GB. Those 32 prompts alone
  would take 4,096 blocks, 98% of this pool's KV cache, leaving nothing to
  run on. So the default is 24 groups of 1,536-token system prompts (96 blocks
  each, the issue's live measurement used 24 groups of 1,500-word prompts):
  all 24 take 55% of the pool, so a router that gives each pod its 4 groups
  keeps them cached (384 of 700 blocks) with room for about ten running
  requests per pod, while a pod that sees every group (random routing) can
  keep only a few of the 24 and recomputes the rest. Questions are 128 to 384
  tokens (mean 256, each one different), outputs 256 tokens as published.
  The best possible hit rate is then about 85% (the system prompt's full
  blocks out of the whole prompt).
- ``MultiTurn``: chat sessions starting at ``rate / mean turns`` per second
  (so requests arrive at ``rate`` on average); each turn resends the whole
  history (a 256-token system prompt shared by every session, then every
  user message and assistant reply so far) plus the new user message, and is
  sent a think time (exponential, mean 5 s) after the previous reply
  completes. 2 to 6 turns, user messages 32 to 160 tokens, replies 64 to 256:
  the longest history stays under 3,000 tokens, inside the 4,096-token
  context with room for the reply.
- ``Mixed``: ``SharedPrefix`` whose first 12 groups each use their own LoRA
  adapter (``adapter-0`` .. ``adapter-11``, the seed experiment's 12) and whose
  other 12 use the base model: affinity for adapters and for prefixes at once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Final

from policyd.sim.names import adapter_names
from policyd.sim.open_loop import OpenRequest, Turn
from policyd.sim.tokenizer import tokenize_chat

# Common English words: prompts read like text and tokenize one id per word.
_WORD_LIST: Final = """
    the of and to in is that for it as was with be by on not he this are or his from at
    which but have an they you were her she there been one all we their has would when if
    so no will more can about what up out into them some could time two may then do first
    any now such like other how its our over only new these also people made between after
    many before must through back years where much your way well down should because each
    just those make good very still own see even work long same here might state great old
    another come around while three small found part against place high number course world
    system again point form group need water use during without service plan answer policy
    customer account order request model data report question team product price support
    quality review change update release network server cluster memory cache query route
    balance latency throughput window budget schedule contract invoice payment shipping
"""
_WORDS: Final = tuple(_WORD_LIST.split())


def prose(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of text: sentences of 6 to 17 words, each ending with a full stop."""
    sentences: list[str] = []
    left = tokens
    while left > 1:
        words = min(rng.randint(6, 17), left - 1)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(words))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
        left -= words + 1
    return " ".join(sentences)


def _arrivals(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    """Poisson arrival times in [0, duration_s) at ``rate`` per second."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("a workload needs a positive rate and duration")
    times: list[float] = []
    now = rng.expovariate(rate)
    while now < duration_s:
        times.append(now)
        now += rng.expovariate(rate)
    return times


def _request(
    at_s: float,
    adapter: str | None,
    messages: list[tuple[str, str]],
    output_length: int,
    *,
    follows: int | None = None,
    group: str = "",
) -> OpenRequest:
    return OpenRequest(
        at_s,
        adapter,
        tuple(Turn(role, (text,)) for role, text in messages),
        tuple(tokenize_chat({"role": role, "content": text} for role, text in messages)),
        output_length,
        output_length,
        follows,
        group,
    )


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Groups of users sharing long system prompts (the module docstring says why this shape).

    ``adapters`` of the groups (the first ones) each use their own LoRA
    adapter; the others use the base model.
    """

    groups: int = 24
    system_tokens: int = 1536
    question_tokens: tuple[int, int] = (128, 384)
    output_tokens: int = 256
    adapters: int = 0

    def __post_init__(self) -> None:
        low, high = self.question_tokens
        if self.groups < 1 or self.system_tokens < 1 or not 1 <= low <= high:
            raise ValueError("a shared-prefix workload needs groups, a system prompt, questions")
        if not 0 <= self.adapters <= self.groups or self.output_tokens < 1:
            raise ValueError("adapters must be within 0..groups, output_tokens positive")

    def requests(self, *, rate: float, duration_s: float, seed: int) -> tuple[OpenRequest, ...]:
        rng = random.Random(f"shared-prefix-{seed}")
        names = adapter_names(self.adapters)
        systems = [
            f"You are the assistant of group {g}. " + prose(rng, self.system_tokens - 8)
            for g in range(self.groups)
        ]
        requests = []
        for at in _arrivals(rng, rate, duration_s):
            group = rng.randrange(self.groups)
            question = prose(rng, rng.randint(*self.question_tokens))
            requests.append(
                _request(
                    at,
                    names[group] if group < self.adapters else None,
                    [("system", systems[group]), ("user", question)],
                    self.output_tokens,
                    group=f"group-{group}",
                )
            )
        return tuple(requests)


def Mixed() -> SharedPrefix:  # noqa: N802 - a workload named like the others
    """LoRA adapters and shared prefixes together: 12 adapter groups, 12 base-model groups."""
    return SharedPrefix(adapters=12)


@dataclass(frozen=True, slots=True)
class MultiTurn:
    """Chat sessions whose every turn resends the growing history (see the module docstring)."""

    system_tokens: int = 256
    turns: tuple[int, int] = (2, 6)
    user_tokens: tuple[int, int] = (64, 320)
    reply_tokens: tuple[int, int] = (64, 256)
    think_s: float = 5.0

    def __post_init__(self) -> None:
        if not 1 <= self.turns[0] <= self.turns[1] or self.think_s < 0:
            raise ValueError("sessions need 1 <= min turns <= max turns and a think time >= 0")
        if not 1 <= self.user_tokens[0] <= self.user_tokens[1]:
            raise ValueError("user messages need 1 <= min <= max tokens")
        if not 1 <= self.reply_tokens[0] <= self.reply_tokens[1]:
            raise ValueError("replies need 1 <= min <= max tokens")

    def requests(self, *, rate: float, duration_s: float, seed: int) -> tuple[OpenRequest, ...]:
        """Sessions starting at ``rate`` / mean turns per second: ``rate`` requests/s on average."""
        rng = random.Random(f"multi-turn-{seed}")
        system = "You are a helpful assistant. " + prose(rng, self.system_tokens - 6)
        mean_turns = (self.turns[0] + self.turns[1]) / 2
        requests: list[OpenRequest] = []
        for session, start in enumerate(_arrivals(rng, rate / mean_turns, duration_s)):
            history = [("system", system)]
            previous: int | None = None
            for turn in range(rng.randint(*self.turns)):
                history.append(("user", prose(rng, rng.randint(*self.user_tokens))))
                reply = rng.randint(*self.reply_tokens)
                at = (
                    start
                    if turn == 0
                    else rng.expovariate(1 / self.think_s)
                    if self.think_s
                    else 0.0
                )
                requests.append(
                    _request(at, None, history, reply, follows=previous, group=f"session-{session}")
                )
                previous = len(requests) - 1
                history.append(("assistant", prose(rng, reply)))
        return tuple(requests)


@dataclass(frozen=True, slots=True)
class Classes:
    """Short chat requests from several classes sharing the rate: tenants, or criticalities.

    Each request belongs to one class (its ``group``), drawn by the classes'
    shares of ``rate``; prompts of ``prompt_tokens`` and outputs of
    ``output_tokens`` (uniform), the base model, no shared prefix: load, not
    locality. Flow control's workloads (``benchmarks/quality.py --workload
    overload|tenants|priorities``) are instances of it.
    """

    shares: tuple[tuple[str, float], ...] = (("all", 1.0),)
    prompt_tokens: tuple[int, int] = (64, 512)
    output_tokens: tuple[int, int] = (32, 256)

    def __post_init__(self) -> None:
        if not self.shares or any(share <= 0 for _, share in self.shares):
            raise ValueError("classes need positive shares")
        if not 1 <= self.prompt_tokens[0] <= self.prompt_tokens[1]:
            raise ValueError("prompts need 1 <= min <= max tokens")
        if not 1 <= self.output_tokens[0] <= self.output_tokens[1]:
            raise ValueError("outputs need 1 <= min <= max tokens")

    def requests(self, *, rate: float, duration_s: float, seed: int) -> tuple[OpenRequest, ...]:
        rng = random.Random(f"classes-{seed}")
        names = [name for name, _ in self.shares]
        weights = [share for _, share in self.shares]
        requests = []
        for at in _arrivals(rng, rate, duration_s):
            group = rng.choices(names, weights)[0]
            question = prose(rng, rng.randint(*self.prompt_tokens))
            output = rng.randint(*self.output_tokens)
            requests.append(_request(at, None, [("user", question)], output, group=group))
        return tuple(requests)


def Overload() -> Classes:  # noqa: N802 - a workload named like the others
    """One class of traffic: what flow control does for the pool as a whole."""
    return Classes()


def Tenants() -> Classes:  # noqa: N802
    """Two tenants offering load 10:1 (``tenant-a`` the flood, ``tenant-b`` the small one)."""
    return Classes((("tenant-a", 10.0), ("tenant-b", 1.0)))


def Priorities() -> Classes:  # noqa: N802
    """A mix of criticalities: 20% critical, 50% standard, 30% sheddable."""
    return Classes((("critical", 0.2), ("standard", 0.5), ("sheddable", 0.3)))


# llm-d's objective headers (policyd reads them into request.slo_*, docs/policy-language.md)
# and the Gateway API Inference Extension's criticality header, as a client sends them.
SLO_TTFT_HEADER: Final = "x-llm-d-slo-ttft-ms"
SLO_TPOT_HEADER: Final = "x-llm-d-slo-tpot-ms"
CRITICALITY_HEADER: Final = "x-gateway-inference-criticality"


@dataclass(frozen=True, slots=True)
class SloClass:
    """One class of an SLO workload: its share of the rate, its shape, what its client states.

    ``slo_ttft_ms`` / ``slo_tpot_ms`` are 0 for a class that states no
    objective; a streamed class reads its answer token by token (TPOT is
    only observable, and stated, for those).
    """

    name: str
    share: float
    prompt_tokens: tuple[int, int]
    max_tokens: int
    criticality: str
    streamed: bool
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0

    def headers(self) -> dict[str, str]:
        """The headers its client sends: criticality, and the objectives it states."""
        found = {CRITICALITY_HEADER: self.criticality}
        if self.slo_ttft_ms > 0:
            found[SLO_TTFT_HEADER] = f"{self.slo_ttft_ms:g}"
        if self.slo_tpot_ms > 0:
            found[SLO_TPOT_HEADER] = f"{self.slo_tpot_ms:g}"
        return found


# The V1 profile (``l4-llama3.1-8b``) serves a 512-token prompt's first token in
# about 0.2 s idle, and a pod busy prefilling a long batch prompt takes ~0.5 s a
# step (its 2,048-token budget): 1 s of TTFT objective is tight only where a
# request lands behind such prefills or a queue, which is what routing decides.
INTERACTIVE: Final = SloClass(
    "interactive", 0.5, (64, 512), 256, "critical", True, slo_ttft_ms=1000.0, slo_tpot_ms=250.0
)
BATCH: Final = SloClass("batch", 0.3, (1024, 3072), 512, "standard", False)
SHEDDABLE: Final = SloClass("sheddable", 0.2, (64, 512), 256, "sheddable", True, slo_ttft_ms=1000.0)


@dataclass(frozen=True, slots=True)
class SloMix:
    """Interactive chat with latency objectives, batch without, and a sheddable class.

    - ``interactive``: critical chat, streamed, stating a TTFT objective and a
      TPOT objective (llm-d's ``x-llm-d-slo-ttft-ms`` / ``x-llm-d-slo-tpot-ms``);
    - ``batch``: long documents (1,024 to 3,072 tokens) answered whole, no
      objective: throughput;
    - ``sheddable``: short streamed requests marked sheddable, stating a TTFT
      objective: a policy may refuse one no pod can serve in time.

    Prompts are each their own (no shared prefix: the load, not locality,
    decides); arrivals are Poisson at ``rate``, each request's class drawn by
    the shares. A request's ``group`` is its class's name (``of``).
    """

    classes: tuple[SloClass, ...] = (INTERACTIVE, BATCH, SHEDDABLE)

    def __post_init__(self) -> None:
        if not self.classes or any(c.share <= 0 for c in self.classes):
            raise ValueError("an SLO workload needs classes with positive shares")
        if len({c.name for c in self.classes}) != len(self.classes):
            raise ValueError("the classes of an SLO workload need distinct names")

    def of(self, group: str) -> SloClass:
        """The class of a request (its ``group``)."""
        for found in self.classes:
            if found.name == group:
                return found
        raise KeyError(f"no class {group!r} in this SLO workload")

    def requests(self, *, rate: float, duration_s: float, seed: int) -> tuple[OpenRequest, ...]:
        rng = random.Random(f"slo-mix-{seed}")
        weights = [c.share for c in self.classes]
        requests = []
        for at in _arrivals(rng, rate, duration_s):
            chosen = rng.choices(self.classes, weights)[0]
            question = prose(rng, rng.randint(*chosen.prompt_tokens))
            requests.append(
                _request(at, None, [("user", question)], chosen.max_tokens, group=chosen.name)
            )
        return tuple(requests)


@dataclass(frozen=True, slots=True)
class RagMix:
    """Long-context RAG mixed with short chat: the workload P/D disaggregation is for.

    - ``rag`` (``rag_share`` of the requests): one of ``documents`` documents
      of 2,000 to 8,000 tokens (drawn once per seed) as the system prompt,
      the prefix every question about it shares, then a question of 16 to
      128 tokens of its own; 100 to 300 output tokens, streamed. A pod that
      holds the document prefills only the question; one that does not
      prefills thousands of tokens, the long prefill that stalls the decode
      steps it is batched with.
    - ``chat``: a prompt of 32 to 512 tokens of its own and 100 to 300 output
      tokens, streamed.

    Half and half by default: a pool serving only RAG questions has no short
    requests whose inter-token latency long prefills could hurt, and one
    serving mostly chat has few long prefills to move. 12 documents of 5,000
    tokens on average take about 60,000 tokens of KV cache, more than one
    ``l4-llama3.1-8b`` pod holds (2,300 blocks of 16: 36,800 tokens), so
    where a question lands decides whether its document is cached there.
    Arrivals are Poisson at ``rate``; a request's ``group`` is ``chat`` or
    ``doc-<n>``, its document.
    """

    documents: int = 12
    document_tokens: tuple[int, int] = (2000, 8000)
    question_tokens: tuple[int, int] = (16, 128)
    chat_tokens: tuple[int, int] = (32, 512)
    output_tokens: tuple[int, int] = (100, 300)
    rag_share: float = 0.5

    def __post_init__(self) -> None:
        if self.documents < 1 or not 0.0 <= self.rag_share <= 1.0:
            raise ValueError("a RAG workload needs documents and a share within 0..1")
        for low, high in (
            self.document_tokens,
            self.question_tokens,
            self.chat_tokens,
            self.output_tokens,
        ):
            if not 1 <= low <= high:
                raise ValueError("token ranges need 1 <= min <= max")

    @staticmethod
    def is_rag(group: str) -> bool:
        """Whether a request of ``group`` is a RAG question (else a chat turn)."""
        return group.startswith("doc-")

    def requests(self, *, rate: float, duration_s: float, seed: int) -> tuple[OpenRequest, ...]:
        rng = random.Random(f"rag-mix-{seed}")
        documents = [
            f"Answer from document {d}. " + prose(rng, rng.randint(*self.document_tokens) - 5)
            for d in range(self.documents)
        ]
        requests = []
        for at in _arrivals(rng, rate, duration_s):
            output = rng.randint(*self.output_tokens)
            if rng.random() < self.rag_share:
                d = rng.randrange(self.documents)
                question = prose(rng, rng.randint(*self.question_tokens))
                messages = [("system", documents[d]), ("user", question)]
                requests.append(_request(at, None, messages, output, group=f"doc-{d}"))
            else:
                chat = prose(rng, rng.randint(*self.chat_tokens))
                requests.append(_request(at, None, [("user", chat)], output, group="chat"))
        return tuple(requests)
