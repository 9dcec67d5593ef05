"""The pool's published snapshot of its pods.

``Pod`` (generated from ``policyd.fields.POD_FIELDS`` into ``pod_types``) and
``InFlight`` are re-exported here, where the rest of policyd imports them.
"""

from __future__ import annotations

import dataclasses

from policyd.pool.inflight import InFlight
from policyd.pool.pod_types import Pod

__all__ = ["EMPTY_SNAPSHOT", "InFlight", "Pod", "PoolSnapshot"]


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
