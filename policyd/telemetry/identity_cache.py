"""What telemetry works out once per object, kept for as long as that object is.

A reused filter-tree walk hands the same step and trace objects to many
requests, and a tracer gives every span the same resource and scope: what
telemetry derives from them (tally increments, span-event attributes, OTLP
bytes) is made once per object. Objects such as these need not be hashable,
and equal ones may differ in what matters, so entries are keyed by identity.
"""

from __future__ import annotations

from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class IdentityCache(Generic[K, V]):
    """Values by the identity of their key object; emptied when it holds ``limit``.

    Each entry holds its key too, so the key's ``id`` cannot be reused by
    another object while the entry lives. Not thread-safe (one owner).
    """

    __slots__ = ("_entries", "_limit")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._entries: dict[int, tuple[K, V]] = {}

    def get(self, key: K) -> V | None:
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0] is key else None

    def keep(self, key: K, value: V) -> V:
        """Keep ``value`` for ``key`` and return it."""
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[id(key)] = (key, value)
        return value
