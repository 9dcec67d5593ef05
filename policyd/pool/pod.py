"""A model-server pod as routing policies see it, and the pool's published snapshot.

``Pod``'s attributes are the CEL schema's ``pod`` fields, made from their
declarations (``policyd.fields.POD_FIELDS``): adding a field there adds it
here, with its default. ``in_flight`` is not stored: it reads the pod's
``InFlight`` counter, which outlives snapshots. Nor are the prefix fields
(``prefix_match``, ``prefix_tokens``): they belong to one request, so a
snapshot's pod answers their defaults, and the router lays each request's
values over the pods for a policy that reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from policyd.cel.values import Duration
from policyd.fields import (
    POD_FIELDS,
    PREFIX_POD_FIELDS,
    SCRAPED_POD_FIELDS,
    Field,
    dataclass_fields,
)


@dataclasses.dataclass(slots=True)
class InFlight:
    """Requests policyd sent to one pod that have not finished yet.

    Mutated only from the event loop (request start / end) and read by policies
    through ``Pod.in_flight``; it lives outside the immutable snapshot so a
    request starting does not force a new snapshot of every pod.
    """

    count: int = 0


def field_default(field: Field) -> object:
    """A declared default as the value a policy reads (a duration's is in seconds)."""
    if field.kind == "duration":
        return Duration.from_seconds(float(field.default))  # type: ignore[arg-type]
    return field.default


# The stored fields, in the order ``Pod``'s constructor takes them: identity,
# the scraped metrics (in the order of ``PodMetrics``), then the rest.
IDENTITY_FIELDS: Final = tuple(f for f in POD_FIELDS if f.origin == "identity")
STORED_FIELDS: Final = (
    *IDENTITY_FIELDS,
    *SCRAPED_POD_FIELDS,
    *(f for f in POD_FIELDS if f.origin in ("serving", "scrape") and f.name != "in_flight"),
)


def _in_flight(self: Any) -> int:
    return self.load.count  # type: ignore[no-any-return]


def _build_pod_class() -> type:
    # Not frozen: the pool builds a Pod for every pod whose metrics changed,
    # every busy pod every round, and a frozen dataclass's __init__ costs
    # several times a plain slotted one's. mypy holds it read-only (below).
    cls = dataclasses.make_dataclass(
        "Pod",
        [
            *dataclass_fields(STORED_FIELDS, field_default),
            (
                "load",
                InFlight,
                dataclasses.field(default_factory=InFlight, compare=False, repr=False),
            ),
        ],
        slots=True,
        namespace={
            "in_flight": property(_in_flight),
            **{field.name: field_default(field) for field in PREFIX_POD_FIELDS},
            "__doc__": "One pod in a published snapshot: identity, last scraped metrics, load.",
        },
    )
    cls.__module__ = __name__
    return cls


if TYPE_CHECKING:

    class Pod:
        """The static face of the class built from the declarations.

        Python code reads the identity by name; the other fields are read by
        policies through CEL or, in Python, by their declarations.
        """

        @property
        def name(self) -> str: ...
        @property
        def address(self) -> str: ...
        @property
        def labels(self) -> Mapping[str, str]: ...
        @property
        def metrics_age(self) -> Duration: ...
        @property
        def load(self) -> InFlight: ...
        @property
        def in_flight(self) -> int: ...
        def __init__(
            self,
            name: str,
            address: str,
            labels: Mapping[str, str] = ...,
            *args: Any,
            metrics_age: Duration = ...,
            load: InFlight = ...,
            **fields: Any,
        ) -> None: ...
        def __getattr__(self, name: str) -> Any: ...

else:
    Pod = _build_pod_class()


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """The pool at one moment.

    ``pods`` holds every known pod (sorted by name), ``candidates`` the ones a
    policy may choose from: answered the last scrape, metrics no older than
    the stale threshold. ``panic`` says no pod met that, and the candidates
    are instead the pods whose last answer is still within the stale
    threshold (see ``Datastore._publish``). ``ready`` says the pool has pods
    and has scraped (answered or failed) each of them at least once; it then
    stays true while pods come and go, so that scaling the model servers up
    does not flap the service's readiness, and turns false only when the pod
    set is empty.
    ``taken_at`` is ``time.monotonic()`` when the
    snapshot was built (``metrics_age`` is measured to it); ``scrape_round``
    counts the rounds that went into it.
    """

    version: int
    pods: tuple[Pod, ...]
    candidates: tuple[Pod, ...]
    ready: bool
    taken_at: float
    scrape_round: int
    panic: bool = False


EMPTY_SNAPSHOT = PoolSnapshot(
    version=0, pods=(), candidates=(), ready=False, taken_at=0.0, scrape_round=0
)
