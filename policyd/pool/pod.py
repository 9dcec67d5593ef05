"""A model-server pod as routing policies see it.

The attribute names are exactly the CEL schema's ``pod`` fields
(``policyd.cel.schema.POD_FIELDS``); a test keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar, dataclass_transform

from policyd.cel.values import ZERO_DURATION, Duration

_Class = TypeVar("_Class")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def _read_only(cls: type[_Class]) -> type[_Class]:
    """A slotted dataclass that the type checker holds read-only, but that is
    not frozen at run time.

    The pool builds a ``Pod`` for every pod whose metrics changed, which is
    every busy pod every scrape round: a hundred pods, ten times a second, on
    the serving loop. A frozen dataclass sets each field through
    ``object.__setattr__``, and its ``__init__`` then costs 2.0-2.7 us where
    a plain slotted one costs 0.34 (``timeit``, eleven fields). mypy still
    rejects any assignment to a field, which is what keeps snapshots
    immutable for the requests reading them.
    """
    return dataclass(slots=True)(cls)


@dataclass(slots=True)
class InFlight:
    """Requests policyd sent to one pod that have not finished yet.

    Mutated only from the event loop (request start / end) and read by policies
    through ``Pod.in_flight``; it lives outside the immutable snapshot so a
    request starting does not force a new snapshot of every pod.
    """

    count: int = 0


@_read_only
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
    # False while the pod's LoRA state is unknown (no LoRA info series scraped
    # yet): the adapter lists are then empty and max_loras 0 for want of
    # knowledge. A Pod made by hand describes a known state unless told.
    lora_info_known: bool = True
    metrics_age: Duration = ZERO_DURATION
    load: InFlight = field(default_factory=InFlight, compare=False, repr=False)

    @property
    def in_flight(self) -> int:
        return self.load.count
