"""The current policy set, replaced atomically when its files change.

Readers (``Router.decide``) take ``store.current`` once per decision; a reload
builds a complete new ``PolicySet`` aside and swaps it in with one reference
assignment. A file that does not load is rejected with its reasons and the old
policy keeps serving. ``watch()`` is a small asyncio task for the service: it
polls the files and does the reading and compiling in a worker thread, so the
event loop never waits for the disk or the CEL checker.

Two guards keep a file that is being written, or was cut short, from
replacing a good policy:

- ``settle_seconds``: the watcher loads a change only once the files' names,
  sizes, modification times and contents have stayed the same for that long,
  and drops a load during which they changed again;
- ``refuse_new_warnings``: a reload whose policy set has a warning the serving
  one does not (an unused param, an unreachable node), or that turns a policy
  with filter nodes, shed nodes or scorers into one with none (a file cut
  before ``filters:``), or whose file now ends mid-line where the serving
  version ended with a line break (a write cut at any byte), is rejected like
  an invalid file.

Both are off by default for the library; ``policyd serve`` turns them on
(``--policy-settle-seconds``, ``--accept-policy-warnings``). Whatever a
reload raises, the watcher logs it, keeps the serving policy and goes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from policyd.policy.compiler import CompiledPolicy
from policyd.policy.diagnostics import Diagnostic, PolicyError
from policyd.policy.loader import load_policy_set, watched_files
from policyd.policy.policyset import PolicySet

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Reload:
    """What one reload attempt did: the set now serving, and the error if rejected.

    ``warnings``: when ``changed``, the new set's warnings (logged by the
    watcher), including the new ones it was allowed to bring.
    """

    current: PolicySet
    changed: bool
    error: PolicyError | None = None
    warnings: tuple[Diagnostic, ...] = ()


@dataclass(frozen=True, slots=True)
class _Stamp:
    """The policy files as last seen: ``content`` (names and bytes) decides whether
    they changed; ``stable`` (with sizes and modification times) whether they are
    still being written."""

    content: str
    stable: str
    # Files whose text does not end with a line break, with the (line, column)
    # just past their last character: the mark of a write cut mid-line.
    unfinished: tuple[tuple[str, tuple[int, int]], ...] = ()


class PolicyStore:
    """Holds the serving ``PolicySet``; optionally knows the path it came from."""

    def __init__(
        self,
        policies: PolicySet,
        path: Path | None = None,
        *,
        settle_seconds: float = 0.0,
        refuse_new_warnings: bool = False,
    ) -> None:
        if not settle_seconds >= 0:
            raise ValueError(f"settle_seconds must not be negative, not {settle_seconds}")
        self._current = policies
        self.path = path
        self.settle_seconds = settle_seconds
        self.refuse_new_warnings = refuse_new_warnings
        stamp = _stamp(watched_files(path, policies)) if path is not None else _Stamp("", "")
        self._fingerprint = stamp.content
        self._unfinished = frozenset(file for file, _ in stamp.unfinished)
        self._pending: tuple[str, float] | None = None  # (stable stamp, first seen)
        self._failure = ""  # the last exception the watcher logged

    @classmethod
    def open(
        cls, path: Path, *, settle_seconds: float = 0.0, refuse_new_warnings: bool = False
    ) -> PolicyStore:
        """Load ``path`` (a file or a directory); raise ``PolicyError`` if it is invalid."""
        files = watched_files(path, None)
        fingerprint = _stamp(files).content  # before loading: a change meanwhile is seen next poll
        store = cls(
            load_policy_set(path),
            path,
            settle_seconds=settle_seconds,
            refuse_new_warnings=refuse_new_warnings,
        )
        if watched_files(path, store.current) == files:
            store._fingerprint = fingerprint
        return store

    @property
    def current(self) -> PolicySet:
        return self._current

    def swap(self, policies: PolicySet) -> None:
        self._current = policies  # one reference assignment: readers see old or new

    def reload(self) -> Reload:
        """Load the path again now if its files changed; keep the old set on any error.

        A rejected version is reported once, not again on every later poll.
        Ignores ``settle_seconds`` (the watcher's ``poll`` applies it).
        """
        if self.path is None:
            return Reload(self._current, changed=False)
        files = watched_files(self.path, self._current)
        stamp = _stamp(files)
        if stamp.content == self._fingerprint:
            return Reload(self._current, changed=False)
        return self._load(files, stamp, settle=False) or Reload(self._current, changed=False)

    def poll(self, now: float | None = None) -> Reload | None:
        """One look of the watcher: a ``Reload`` when a change was loaded or rejected,
        None when nothing changed or the files have not settled yet.

        ``now`` is a ``time.monotonic()`` reading (given by tests).
        """
        if self.path is None:
            return None
        now = time.monotonic() if now is None else now
        files = watched_files(self.path, self._current)
        stamp = _stamp(files)
        if stamp.content == self._fingerprint:
            self._pending = None
            self._failure = ""
            return None
        if self.settle_seconds > 0:
            if self._pending is None or self._pending[0] != stamp.stable:
                self._pending = (stamp.stable, now)  # (still) changing: look again later
                return None
            if now - self._pending[1] < self.settle_seconds:
                return None
        self._pending = None
        return self._load(files, stamp, settle=self.settle_seconds > 0, now=now)

    def _load(
        self, files: list[Path], stamp: _Stamp, *, settle: bool, now: float = 0.0
    ) -> Reload | None:
        path = self.path
        assert path is not None
        try:
            policies = load_policy_set(path)
        except PolicyError as error:
            result = Reload(self._current, changed=False, error=error)
        else:
            result = self._guarded(policies, stamp)
        if settle:
            after = _stamp(files)
            if after.stable != stamp.stable:  # written to while it loaded: not this version
                self._pending = (after.stable, now)
                return None
        self._fingerprint = stamp.content  # a rejected version is reported once
        self._failure = ""
        if result.changed:
            self.swap(result.current)
            self._unfinished = frozenset(file for file, _ in stamp.unfinished)
            new_files = watched_files(path, result.current)
            if new_files != files:  # other shadow files named now: watch those from here on
                new_stamp = _stamp(new_files)
                self._fingerprint = new_stamp.content
                self._unfinished = frozenset(file for file, _ in new_stamp.unfinished)
        return result

    def _guarded(self, policies: PolicySet, stamp: _Stamp) -> Reload:
        """``policies`` as a swap, or as a rejection for the warnings it would bring."""
        brought = new_warnings(self._current, policies) + [
            Diagnostic(
                file,
                *end,
                "the file ends mid-line (no final line break), unlike the version serving "
                "now: is the file complete?",
                "warning",
            )
            for file, end in stamp.unfinished
            if file not in self._unfinished
        ]
        if brought and self.refuse_new_warnings:
            refusal = Diagnostic(
                str(self.path),
                1,
                1,
                f"reload refused: {_count(len(brought), 'warning')} that the policy serving "
                "now does not have (listed here); fix the file, or let reloads accept new "
                "warnings (policyd serve --accept-policy-warnings)",
            )
            return Reload(self._current, changed=False, error=PolicyError([refusal, *brought]))
        return Reload(
            policies, changed=True, warnings=tuple(sorted({*policies.warnings, *brought}))
        )

    async def watch(
        self, interval: float = 1.0, on_reload: Callable[[Reload], None] | None = None
    ) -> None:
        """Look every ``interval`` seconds, off the event loop, until cancelled.

        Each change that loads, or is rejected, is logged (a loaded one with its
        warnings) and passed to ``on_reload`` (for metrics or a status endpoint).
        An exception anywhere in a reload, or in ``on_reload``, is logged (once
        while it repeats) and the serving policy stays: this task ends only
        when cancelled.
        """
        if self.path is None:
            raise ValueError("this store was not loaded from a path")
        if not interval > 0:
            raise ValueError(f"interval must be positive, not {interval}")
        while True:
            await asyncio.sleep(self._next_look(interval))
            result: Reload | None = None
            try:
                result = await asyncio.to_thread(self.poll)
                if result is not None:
                    _report(result)
            except Exception as error:  # a bug or an odd file system: never end the watch
                failure = self._failed(error)
                result = result or failure
            if result is not None and on_reload is not None:
                try:
                    on_reload(result)
                except Exception:
                    _log.exception("a policy reload listener failed")

    def _next_look(self, interval: float) -> float:
        if self._pending is None:
            return interval
        remaining = self._pending[1] + self.settle_seconds - time.monotonic()
        return min(interval, max(remaining, 0.01))

    def _failed(self, error: Exception) -> Reload | None:
        self._pending = None  # look again after a whole interval, not at once
        described = f"{type(error).__name__}: {error}"
        if described == self._failure:
            return None  # logged already; it is tried again on every look
        self._failure = described
        _log.error(
            "policy reload failed; still serving %s",
            self._current.version,
            exc_info=(type(error), error, error.__traceback__),
        )
        diagnostic = Diagnostic(str(self.path), 1, 1, f"reload failed: {described}")
        return Reload(self._current, changed=False, error=PolicyError([diagnostic]))


def _report(result: Reload) -> None:
    if result.error is not None:
        _log.error(
            "policy change rejected; still serving %s:\n%s", result.current.version, result.error
        )
    elif result.changed:
        _log.info("policy %s now serving", result.current.version)
        for warning in result.warnings:
            _log.warning("policy: %s", warning)


def new_warnings(old: PolicySet, new: PolicySet) -> list[Diagnostic]:
    """What ``new`` would bring that ``old`` does not have, as warnings.

    A loader warning counts by file and message (an edit above it moves its
    line); so does a policy (same file) whose filter nodes, shed nodes or
    scorers all went, the mark of a file cut short (reported at its name).
    """
    known = {(w.path, w.message) for w in old.warnings}
    found = [w for w in new.warnings if (w.path, w.message) not in known]
    before = {policy.path: policy for policy in old.policies}
    for policy in new.policies:
        previous = before.get(policy.path)
        if previous is None:
            continue
        for what, count in _SECTIONS:
            had = count(previous)
            if had and not count(policy):
                message = (
                    f"policy '{policy.name}' had {_count(had, what)} and now has none: "
                    "is the file complete?"
                )
                found.append(Diagnostic(policy.path, *policy.name_at, message, "warning"))
    return found


_SECTIONS: tuple[tuple[str, Callable[[CompiledPolicy], int]], ...] = (
    ("filter node", lambda policy: len(policy.nodes)),
    ("shed node", lambda policy: sum(node.kind == "shed" for node in policy.nodes.values())),
    ("scorer", lambda policy: len(policy.scorers)),
)


def _count(number: int, thing: str) -> str:
    return f"{number} {thing}" + ("" if number == 1 else "s")


def _stamp(files: list[Path]) -> _Stamp:
    """Hashes of the policy files (and their shadows): names and contents, and
    those with sizes and modification times."""
    content = hashlib.sha256()
    stable = hashlib.sha256()
    unfinished: list[tuple[str, tuple[int, int]]] = []
    for file in files:
        name = str(file).encode() + b"\0"
        content.update(name)
        stable.update(name)
        try:
            status = file.stat()
            data = file.read_bytes()
        except OSError as error:
            unreadable = f"unreadable: {error}\0".encode()
            content.update(unreadable)
            stable.update(unreadable)
            continue
        content.update(data)
        stable.update(f"{status.st_size} {status.st_mtime_ns}\0".encode())
        stable.update(data)
        if data and not data.endswith(b"\n"):
            last_line = data[data.rfind(b"\n") + 1 :].decode("utf-8", "replace")
            unfinished.append((str(file), (data.count(b"\n") + 1, len(last_line) + 1)))
    return _Stamp(content.hexdigest(), stable.hexdigest(), tuple(unfinished))
