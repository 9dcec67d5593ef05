"""The rig of the flow-control tests: a real router and policy, pods whose load the
test moves, and clients that route a dispatched request as the serving path does."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policyd.flow import FlowAnswer, FlowControl, Held, Pass, unwrap
from policyd.flow.unseen import ROUNDS
from policyd.policy import PolicyStore, Request, Router
from policyd.pool.pod import Pod
from tests.policy.helpers import pod, write

POLICY = """
name: held
filters:
  all:
    keep: "true"
flow:
  saturated: pod.waiting_queue >= 2 || pod.in_flight >= 2
  bands:
    critical: {max_wait: 30s}
    standard: {max_wait: 10s}
  flows:
    key: request.headers["x-tenant"]
  answer: {status: 429, retry_after: 3s}
"""


@dataclass
class Snapshot:
    candidates: tuple[Pod, ...]
    version: int = 0


@dataclass(eq=False)
class Client:
    """A request's owner: sends it to a pod (counting it there) or takes the answer."""

    name: str
    router: Router
    sent_to: str | None = None
    answered: FlowAnswer | None = None
    saw: list[str] = field(default_factory=list)

    def dispatch(self, candidates: Sequence[Any]) -> str | None:
        self.saw = [p.name for p in candidates]
        decision = self.router.decide(Request("m"), candidates)
        chosen: Pod = unwrap(decision.chosen)
        chosen.load.count += 1
        self.sent_to = chosen.name
        return self.sent_to

    def answer(self, answer: FlowAnswer) -> None:
        self.answered = answer


class Rig:
    def __init__(self, tmp_path: Path, text: str = POLICY, pods: int = 2) -> None:
        self.path = write(tmp_path, text)
        self.store = PolicyStore.open(self.path)
        self.router = Router(self.store, rng=random.Random(1))
        self.snapshot = Snapshot(tuple(pod(f"p{i}") for i in range(pods)))
        self.now = 0.0
        self.control = FlowControl(lambda: self.router, lambda: self.snapshot, lambda: self.now)

    def arrive(
        self, name: str, tokens: tuple[int, int] = (0, 0), /, **headers: str
    ) -> tuple[Client, Pass | Held | FlowAnswer]:
        """A request (``tokens``: its prompt and max_tokens) arrives; routed when it passes."""
        request = Request("m", headers=headers, prompt_tokens=tokens[0], max_tokens=tokens[1])
        client = Client(name, self.router)
        admission = self.router.admission(request)
        assert admission is not None
        verdict = self.control.arrive(admission, request, 10, client)
        if isinstance(verdict, Pass):
            client.dispatch(verdict.candidates)
            self.control.sent(client.sent_to or "", client)
        return client, verdict

    def end(self, client: Client, reported: tuple[int, int] | None = None) -> None:
        """The request's response ended (``reported``: the usage its pod counted):
        its pod frees a slot."""
        for p in self.snapshot.candidates:
            if p.name == client.sent_to:
                p.load.count -= 1
        self.control.finished(client.sent_to or "", client, reported)


KV_POLICY = POLICY.replace("pod.waiting_queue >= 2 || pod.in_flight >= 2", "pod.kv_cache >= 0.5")


def kv_rig(tmp_path: Path) -> Rig:
    """Two pods of 1000 tokens of KV cache each, empty as scraped."""
    rig = Rig(tmp_path, KV_POLICY)
    rig.snapshot = Snapshot(
        tuple(pod(f"p{i}", kv_cache_blocks=100, kv_block_size=10) for i in range(2))
    )
    return rig


def rescrape(
    rig: Rig, kv_cache: float | Sequence[float], running: Sequence[int] | None = None
) -> None:
    """A new snapshot: the pods read ``kv_cache`` (one for both, or one each) and run
    ``running`` requests (default: those policyd counts in flight there), and keep the
    requests they serve."""
    old = rig.snapshot.candidates
    readings = [kv_cache] * len(old) if isinstance(kv_cache, float) else list(kv_cache)
    counts = [p.load.count for p in old] if running is None else list(running)
    pods = tuple(
        pod(
            f"p{i}",
            kv_cache=reading,
            running=count,
            kv_cache_blocks=100,
            kv_block_size=10,
        )
        for i, (reading, count) in enumerate(zip(readings, counts, strict=True))
    )
    for p, before in zip(pods, old, strict=True):
        p.load.count = before.load.count
    rig.snapshot = Snapshot(pods, version=rig.snapshot.version + 1)


def settle(
    rig: Rig, kv_cache: float | Sequence[float], running: Sequence[int] | None = None
) -> None:
    """Snapshots enough that every request sent so far shows in the scrape
    (``policyd.flow.unseen.ROUNDS``), each reading as ``rescrape`` says."""
    for _ in range(ROUNDS):
        rescrape(rig, kv_cache, running)
