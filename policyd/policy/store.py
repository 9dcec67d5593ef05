"""The current policy set, replaced atomically when its files change.

Readers (``Router.decide``) take ``store.current`` once per decision; a reload
builds a complete new ``PolicySet`` aside and swaps it in with one reference
assignment. A file that does not load is rejected with its reasons and the old
policy keeps serving. ``watch()`` is a small asyncio task for the service: it
polls the files' contents and does the reading and compiling in a worker
thread, so the event loop never waits for the disk or the CEL checker.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from policyd.policy.diagnostics import PolicyError
from policyd.policy.loader import load_policy_set, watched_files
from policyd.policy.policyset import PolicySet

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Reload:
    """What one reload attempt did: the set now serving, and the error if rejected."""

    current: PolicySet
    changed: bool
    error: PolicyError | None = None


class PolicyStore:
    """Holds the serving ``PolicySet``; optionally knows the path it came from."""

    def __init__(self, policies: PolicySet, path: Path | None = None) -> None:
        self._current = policies
        self.path = path
        self._fingerprint = _fingerprint(watched_files(path, policies)) if path is not None else ""

    @classmethod
    def open(cls, path: Path) -> PolicyStore:
        """Load ``path`` (a file or a directory); raise ``PolicyError`` if it is invalid."""
        files = watched_files(path, None)
        fingerprint = _fingerprint(files)  # before loading: a change meanwhile is seen next poll
        store = cls(load_policy_set(path), path)
        if watched_files(path, store.current) == files:
            store._fingerprint = fingerprint
        return store

    @property
    def current(self) -> PolicySet:
        return self._current

    def swap(self, policies: PolicySet) -> None:
        self._current = policies  # one reference assignment: readers see old or new

    def reload(self) -> Reload:
        """Load the path again if its files changed; keep the old set on any error.

        A rejected version is reported once, not again on every later poll.
        """
        if self.path is None:
            return Reload(self._current, changed=False)
        files = watched_files(self.path, self._current)
        fingerprint = _fingerprint(files)
        if fingerprint == self._fingerprint:
            return Reload(self._current, changed=False)
        self._fingerprint = fingerprint
        try:
            policies = load_policy_set(self.path)
        except PolicyError as error:
            return Reload(self._current, changed=False, error=error)
        self.swap(policies)
        new_files = watched_files(self.path, policies)
        if new_files != files:  # other shadow files named now: watch those from here on
            self._fingerprint = _fingerprint(new_files)
        return Reload(policies, changed=True)

    async def watch(
        self, interval: float = 1.0, on_reload: Callable[[Reload], None] | None = None
    ) -> None:
        """Reload every ``interval`` seconds, off the event loop, until cancelled.

        Each change that loads, or fails to, is logged and passed to
        ``on_reload`` (for metrics or a status endpoint).
        """
        if self.path is None:
            raise ValueError("this store was not loaded from a path")
        while True:
            await asyncio.sleep(interval)
            result = await asyncio.to_thread(self.reload)
            if result.error is not None:
                _log.error(
                    "policy change rejected; still serving %s:\n%s",
                    result.current.version,
                    result.error,
                )
            elif result.changed:
                _log.info("policy %s now serving", result.current.version)
            else:
                continue
            if on_reload is not None:
                on_reload(result)


def _fingerprint(files: list[Path]) -> str:
    """A hash of the names and contents of the policy files (and their shadows)."""
    digest = hashlib.sha256()
    try:
        for file in files:
            digest.update(str(file).encode() + b"\0")
            digest.update(file.read_bytes())
    except OSError as error:
        digest.update(f"unreadable: {error}".encode())
    return digest.hexdigest()
