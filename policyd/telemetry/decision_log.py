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
"""

from __future__ import annotations

import json
import logging
import queue
import random
import sys
import threading
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
        draw: Callable[[], float] = random.random,
    ) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"the decision log sample rate must be in [0, 1], not {sample_rate}")
        self.sample_rate = sample_rate
        self.max_pods = max_pods
        self.written = 0
        self.dropped = 0
        self._out = out
        self._close_out = close_out
        self._draw = draw
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_limit)
        self._thread = threading.Thread(target=self._run, name="policyd-decision-log", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, target: str, **options: Any) -> DecisionLog:
        """``-`` for standard output, else a file appended to (created if missing)."""
        if target == "-":
            return cls(sys.stdout, **options)
        try:
            out = Path(target).open("a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        except OSError as error:
            raise ValueError(f"cannot open the decision log {target}: {error.strerror}") from None
        return cls(out, close_out=True, **options)

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
            try:
                self._out.write("\n".join(lines) + "\n")
                self._out.flush()
                self.written += len(lines)
            except (OSError, ValueError) as error:  # a closed or full file: say so, go on
                self.dropped += len(lines)
                log.error("cannot write the decision log: %s", error)
