"""``--workers N``: N policyd processes sharing one port.

One Python process routes on one core. Each worker is a full, independent
policyd (its own gRPC server, pool scraper, policy loader and router), bound to
the same port with ``SO_REUSEPORT`` so the kernel spreads Envoy's connections
across them. Nothing is shared, so nothing needs a lock; the cost is that each
worker scrapes the pods itself and counts in-flight requests only for the
streams it serves.

Workers are started with ``spawn`` (a forked gRPC runtime is not safe), so the
target must be an importable module-level function and its argument
picklable; the target builds everything inside the worker. It also gets the
worker's index (0 .. N-1), for what cannot be shared, such as the port of
the Prometheus endpoint. SIGTERM/SIGINT to
the parent is passed on to every worker, which then drains gracefully; if one
worker dies, the others are stopped too, so the supervisor (Kubernetes)
restarts a whole, healthy set. If the parent itself dies without passing
anything on (SIGKILL, the OOM killer), Linux sends each worker SIGTERM
(``PR_SET_PDEATHSIG``): an orphaned worker would otherwise keep the port,
and with ``SO_REUSEPORT`` the next ``policyd serve`` would share its
connections with a process running yesterday's settings.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

log = logging.getLogger("policyd.extproc.workers")

T = TypeVar("T")


def run_in_workers(count: int, target: Callable[[T, int], int], argument: T) -> int:
    """Run ``target(argument, index)`` in ``count`` processes; returns the worst exit code.

    With ``count == 1`` the target runs in this process. The target must bind
    its server with ``reuse_port=True`` when ``count > 1``.
    """
    if count <= 1:
        return target(argument, 0)
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(
            target=_worker,
            args=(target, argument, index, os.getpid()),
            name=f"policyd-worker-{index}",
        )
        for index in range(count)
    ]

    stopping = False

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for worker in workers:
            if worker.is_alive() and worker.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for worker in workers:
            worker.start()
        log.info("started %d workers: %s", count, ", ".join(str(w.pid) for w in workers))
        pending = {worker.sentinel: worker for worker in workers}
        while pending:
            for sentinel in multiprocessing.connection.wait(list(pending)):
                assert isinstance(sentinel, int)  # process sentinels are file descriptors
                finished = pending.pop(sentinel)
                finished.join()
                if not stopping and pending:
                    log.error(
                        "worker %s exited on its own (code %s); stopping the others",
                        finished.pid,
                        finished.exitcode,
                    )
                    forward(signal.SIGTERM, None)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return max(_exit_status(worker.exitcode) for worker in workers)


def _exit_status(exitcode: int | None) -> int:
    if exitcode is None:
        return 1
    return exitcode if exitcode >= 0 else 128 - exitcode  # killed by signal n: 128 + n


def _worker(target: Callable[[T, int], int], argument: T, index: int, parent: int) -> None:
    _stop_with(parent)
    raise SystemExit(target(argument, index))


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _stop_with(parent: int) -> None:
    """Have Linux send this worker SIGTERM when ``parent`` dies (a no-op elsewhere).

    SIGTERM, not SIGKILL: the worker then drains its open streams as it would
    on a supervisor's stop. A parent that died before the request took effect
    is caught by comparing the parent pid afterwards.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("cannot ask to stop with the parent: %s", os.strerror(ctypes.get_errno()))
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
