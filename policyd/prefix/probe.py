"""What the serving path hands the router per request: the prompt's prefix match per pod.

A ``PrefixLocator`` (one per process) holds the tokenizer, the index and the
block size. Each request gets a ``PrefixProbe``, which does nothing until the
router asks: a policy that reads no prefix field costs one object. When asked,
it tokenizes the prompt once, keys it once per (model, block size) and answers
every pod from the index. Pods are named by their ``address`` (``ip:port``) in
both indexes: a pod replaced under the same name at a new address starts with
an empty cache, as its model server does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from policyd.fields.prefix_match import NO_MATCH, PrefixMatch
from policyd.prefix.index import ApproximateIndex, PreciseIndex
from policyd.prefix.keys import block_keys
from policyd.prefix.tokenizers import Tokenizer, TurnLike


class Addressed(Protocol):
    """What the probe reads of a pod: where it is (``ip:port``), which names its cache."""

    @property
    def address(self) -> str: ...


class PrefixLocator:
    """One process's prefix matching: the tokenizer, the index and its mode, the block size.

    ``block_size`` is the pods' KV block size in tokens (vLLM's default is 16);
    in precise mode a pod's announced block size takes precedence.
    """

    def __init__(
        self, tokenizer: Tokenizer, index: ApproximateIndex | PreciseIndex, block_size: int
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"a block size must be positive, got {block_size}")
        self.tokenizer = tokenizer
        self.index = index
        self.block_size = block_size

    @property
    def mode(self) -> str:
        """``approximate`` (learns from policyd's routing) or ``precise`` (from KV events)."""
        return "approximate" if isinstance(self.index, ApproximateIndex) else "precise"

    def probe(self, turns: Sequence[TurnLike]) -> PrefixProbe:
        return PrefixProbe(self, turns)


class PrefixProbe:
    """One request's prompt, matched against the index only when a policy asks."""

    __slots__ = ("_keys", "_locator", "_tokens", "_turns")

    def __init__(self, locator: PrefixLocator, turns: Sequence[TurnLike]) -> None:
        self._locator = locator
        self._turns = turns
        self._tokens: tuple[int, ...] | None = None
        self._keys: dict[tuple[str, int], tuple[int, ...]] = {}

    @property
    def tokens(self) -> tuple[int, ...]:
        """The prompt's token ids (computed on first use)."""
        if self._tokens is None:
            self._tokens = tuple(self._locator.tokenizer.encode(self._turns))
        return self._tokens

    def keys(self, model: str, block_size: int) -> tuple[int, ...]:
        """The prompt's block keys served as ``model`` in ``block_size`` blocks (computed once)."""
        keys = self._keys.get((model, block_size))
        if keys is None:
            keys = self._keys[model, block_size] = block_keys(self.tokens, block_size, model)
        return keys

    def match(self, model: str, pods: Sequence[Addressed]) -> list[PrefixMatch]:
        """Per pod, in order, its ``PrefixMatch``: the fraction 0..1 of the prompt's
        tokens cached there, and those tokens.

        ``model`` is the name the request is served as (the target model or
        adapter).
        """
        prompt = len(self.tokens)
        if not prompt or not pods:
            return [NO_MATCH] * len(pods)
        index = self._locator.index
        default = self._locator.block_size
        names = [pod.address for pod in pods]
        if all(size == default for size in index.block_sizes()):  # every pod cuts alike
            return [
                PrefixMatch(blocks * default / prompt, blocks * default)
                for blocks in index.match(self.keys(model, default), names)
            ]
        sizes = [index.block_size(name) or default for name in names]
        result = [NO_MATCH] * len(names)
        for size in set(sizes):
            positions = [i for i, s in enumerate(sizes) if s == size]
            group = [names[i] for i in positions]
            matched = index.match(self.keys(model, size), group)
            for i, blocks in zip(positions, matched, strict=True):
                result[i] = PrefixMatch(blocks * size / prompt, blocks * size)
        return result

    def routed(self, model: str, pod: str) -> None:
        """The request went to ``pod`` (its address): approximate mode remembers its blocks."""
        index = self._locator.index
        if isinstance(index, ApproximateIndex):
            index.record(pod, self.keys(model, self._locator.block_size))
