"""IdentityCache: values by the identity of their key, bounded."""

from __future__ import annotations

from policyd.telemetry.identity_cache import IdentityCache


def test_values_are_found_by_the_same_object_only() -> None:
    cache: IdentityCache[list[int], str] = IdentityCache(limit=8)
    key = [1, 2]
    assert cache.get(key) is None
    assert cache.keep(key, "kept") == "kept"
    assert cache.get(key) == "kept"
    assert cache.get([1, 2]) is None  # equal, but another object


def test_a_full_cache_starts_again() -> None:
    cache: IdentityCache[object, int] = IdentityCache(limit=2)
    first, second, third = object(), object(), object()
    cache.keep(first, 1)
    cache.keep(second, 2)
    cache.keep(third, 3)
    assert (cache.get(first), cache.get(second), cache.get(third)) == (None, None, 3)
