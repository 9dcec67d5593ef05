"""A model-server pod as routing policies see it.

The attribute names are exactly the CEL schema's ``pod`` fields
(``policyd.cel.schema.POD_FIELDS``); a test keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from policyd.cel.values import ZERO_DURATION, Duration


@dataclass(slots=True)
class InFlight:
    """Requests policyd sent to one pod that have not finished yet.

    Mutated only from the event loop (request start / end) and read by policies
    through ``Pod.in_flight``; it lives outside the immutable snapshot so a
    request starting does not force a new snapshot of every pod.
    """

    count: int = 0


@dataclass(frozen=True, slots=True)
class Pod:
    """One pod in a published snapshot: identity, last scraped metrics, load."""

    name: str
    address: str
    labels: Mapping[str, str] = field(default_factory=dict)
    waiting_queue: int = 0
    running: int = 0
    kv_cache: float = 0.0
    active_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0
    metrics_age: Duration = ZERO_DURATION
    load: InFlight = field(default_factory=InFlight, compare=False, repr=False)

    @property
    def in_flight(self) -> int:
        return self.load.count
