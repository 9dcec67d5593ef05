"""What flow control sent to each pod that the pod's metrics may not show yet (``Unseen``).

A scrape reads a pod as the pod last logged itself, and a request policyd
sends shows there only once it has crossed the proxy, the pod has admitted
it (a model server logs its state at the end of an engine step) and a
scrape has started after that: up to ``ROUNDS`` snapshots after the send
(counted by the snapshots' versions, one a scrape round, whether flow control
looked at each or not).
Until then flow control adds the request's footprint to the pod's scraped
KV cache (``control.py``), so a burst dispatched between scrapes cannot
overfill a pod and queue there, where flow control no longer orders it.

What policyd sees end is not taken off: a response's end reaches policyd
after the pod finished it, by seconds when policyd or the proxy is busy
relaying other streamed responses, and by then the scrape has dropped it
already. Taking it off again read pods emptier than they were; the scrape
alone says what left.
"""

from __future__ import annotations

from collections import deque
from typing import Final

# A send shows in the pod's metrics once it reached the pod (one round), the pod logged
# a step that admitted it (one more) and a scrape started after that (one more).
ROUNDS: Final = 3
# At most this many sends are remembered (a pool whose snapshots stop coming must not
# grow this without bound); past it the oldest counts as seen.
MOST: Final = 1 << 16


class Unseen:
    """Per pod, the requests and tokens sent in the last ``ROUNDS`` snapshots."""

    __slots__ = ("_sends", "_version", "count", "tokens")

    def __init__(self) -> None:
        self._version = 0  # the latest snapshot's
        self._sends: deque[tuple[int, str, int]] = deque()  # (version, pod, tokens)
        self.tokens: dict[str, int] = {}
        self.count: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._sends)

    def sent(self, pod: str, tokens: int) -> None:
        """A request of ``tokens`` (its estimated footprint) went to ``pod``."""
        if len(self._sends) >= MOST:
            self._forget()
        self._sends.append((self._version, pod, tokens))
        self.tokens[pod] = self.tokens.get(pod, 0) + tokens
        self.count[pod] = self.count.get(pod, 0) + 1

    def snapshot_came(self, version: int) -> None:
        """The snapshot of ``version`` came: the sends of ``ROUNDS`` versions before it
        show in it."""
        self._version = version
        sends = self._sends
        while sends and sends[0][0] <= version - ROUNDS:
            self._forget()

    def _forget(self) -> None:
        _, pod, tokens = self._sends.popleft()
        left = self.count[pod] - 1
        if left:
            self.count[pod] = left
            self.tokens[pod] -= tokens
        else:
            del self.count[pod], self.tokens[pod]
