"""The decision log: one JSON line per sampled decision, like OPA's decision logs.

What a line holds is built by ``RequestRecord`` (see ``docs/observability.md``
for the format): the request's inputs, the pods the policy chose from, the tree
walk, the pick, what each shadow policy would have done and how the response
went. This module only samples and writes.

Writing happens on a thread of its own: the event loop hands a finished entry
(a dict) to a bounded queue and goes on; the thread serialises and writes
batches and flushes after each batch, so the file or pipe never blocks request
handling. When the writer cannot keep up, new entries are dropped and counted
(``dropped``) rather than queued without bound.

A log written to a file follows log rotation the way ``logging``'s
``WatchedFileHandler`` does: when the path no longer names the open file
(logrotate moved it away, someone deleted it), the writer opens the path
anew, checking at most once per ``reopen_check_seconds``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TextIO

log = logging.getLogger(__name__)

_STOP: Final = object()
_BATCH: Final = 256


class DecisionLog:
    """Samples decisions and writes the sampled ones as JSON lines."""

    def __init__(
        self,
        out: TextIO,
        *,
        sample_rate: float = 1.0,
        max_pods: int = 32,
        queue_limit: int = 10_000,
        close_out: bool = False,
        path: Path | None = None,
        reopen_check_seconds: float = 1.0,
        draw: Callable[[], float] = random.random,
    ) -> None:
        """``path``: the file ``out`` is open on, reopened when rotated (see above)."""
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"the decision log sample rate must be in [0, 1], not {sample_rate}")
        self.sample_rate = sample_rate
        self.max_pods = max_pods
        self.written = 0
        self.dropped = 0
        self._out = out
        self._close_out = close_out
        self._path = path
        self._reopen_check_seconds = reopen_check_seconds
        self._checked_at = time.monotonic()
        self._draw = draw
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_limit)
        self._thread = threading.Thread(target=self._run, name="policyd-decision-log", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, target: str, **options: Any) -> DecisionLog:
        """``-`` for standard output, else a file appended to (created if missing)."""
        if target == "-":
            return cls(sys.stdout, **options)
        path = Path(target)
        try:
            out = path.open("a", encoding="utf-8")
        except OSError as error:
            raise ValueError(f"cannot open the decision log {target}: {error.strerror}") from None
        return cls(out, close_out=True, path=path, **options)

    def sampled(self) -> bool:
        """Whether to log the decision about to be made (called once per request)."""
        rate = self.sample_rate
        return rate >= 1.0 or (rate > 0.0 and self._draw() < rate)

    def write(self, entry: dict[str, Any]) -> None:
        """Queue one entry; never blocks."""
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("decision log writer is behind: %d entries dropped", self.dropped)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop the writer (and close the file if opened here)."""
        if not self._thread.is_alive():
            return
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._close_out:
            self._out.close()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            while len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            lines = []
            for entry in batch:
                if entry is _STOP:
                    stopping = True
                    continue
                lines.append(json.dumps(entry, separators=(",", ":"), default=str))
            if not lines:
                continue
            self._follow_rotation()
            try:
                self._out.write("\n".join(lines) + "\n")
                self._out.flush()
                self.written += len(lines)
            except (OSError, ValueError) as error:  # a closed or full file: say so, go on
                self.dropped += len(lines)
                log.error("cannot write the decision log: %s", error)

    def _follow_rotation(self) -> None:
        """Open the path anew if it no longer names the file being written (writer thread)."""
        path = self._path
        now = time.monotonic()
        if path is None or now - self._checked_at < self._reopen_check_seconds:
            return
        self._checked_at = now
        try:
            named = os.stat(path)
        except FileNotFoundError:
            named = None
        except OSError:  # cannot tell (a permission changed): keep the open file
            return
        try:
            current = os.fstat(self._out.fileno())
        except (OSError, ValueError):  # closed: the write below reports it
            return
        if named is not None and (named.st_dev, named.st_ino) == (current.st_dev, current.st_ino):
            return
        try:
            fresh = path.open("a", encoding="utf-8")
        except OSError as error:
            log.error("cannot reopen the decision log %s: %s", path, error.strerror)
            return
        self._out.close()
        self._out = fresh
        log.info("decision log %s was moved or removed: writing to a new file there", path)
