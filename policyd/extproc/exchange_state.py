"""Where an ``Exchange`` (``exchange.py``) is in its request's life: ``State``."""

from __future__ import annotations

import enum
from typing import Final


class State(enum.Enum):
    """Where an exchange is. Messages, replies and the stream's end move it on, never back.

    ::

        READING <--dispatched-- HELD (flow control holds the request; or answers it)
        READING --decided--> DECIDED --reply out--> ROUTED --response headers--> RESPONDING
           |                    |                      |                              |
           |                    +-- not routed, or an error --> ANSWERED --reply out--> ENDED
           +-- an error answer ----------------------------^                             ^
                                                       +-- the response's last message --+
        any state but ENDED --the stream goes--> ABORTED (ANSWERED --> ENDED: it had ended)

    ANSWERED is an exchange policyd answered itself (an ImmediateResponse)
    before the reply carrying its decision went out: it is over, but nothing
    is recorded until that reply is out. An error answered after the routing
    reply went out (Envoy repeating a request phase) goes straight to ENDED.
    """

    READING = "reading"  # the request's headers and body arrive; nothing decided yet
    HELD = "held"  # the body is in; flow control holds it until a pod has room
    DECIDED = "decided"  # decided, the span open; the reply carrying it not out yet
    ROUTED = "routed"  # the routing reply is out; the response's headers not yet in
    RESPONDING = "responding"  # the response's headers came; its body passes through
    ANSWERED = "answered"  # policyd answered the request itself; that reply not out yet
    ENDED = "ended"  # over: the response ended, or policyd's answer went out
    ABORTED = "aborted"  # over: the stream went before the exchange ended


# The states of an exchange that is over: it ends once.
OVER: Final = (State.ANSWERED, State.ENDED, State.ABORTED)
