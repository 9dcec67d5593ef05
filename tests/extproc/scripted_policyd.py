"""A policyd process for the signal and ``--workers`` tests.

It runs the real :class:`ExtProcServer` (health, drain on SIGTERM) under the
real :func:`run_in_workers`; only the router is a test double, which routes
every request to ``10.0.0.1:<pid of the worker that decided>`` so a test can
see which worker process served each stream.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from policyd.extproc.grpc_server import ExtProcServer, ServerOptions
from policyd.extproc.workers import run_in_workers
from policyd.policy.decision import Decision, Outcome
from policyd.policy.request import Request
from policyd.pool.pod import Pod


class PidRouter:
    def decide(self, request: Request, candidates: Sequence[Pod], prompt: Any = None) -> Decision:
        return Decision(Outcome.ROUTED, "pid", "1", request.model, f"10.0.0.1:{os.getpid()}")


@dataclass(frozen=True)
class EmptySnapshot:
    candidates: tuple[Pod, ...] = ()


def serve(settings: tuple[int, bool], worker: int) -> int:
    port, reuse_port = settings
    router, snapshot = PidRouter(), EmptySnapshot()
    server = ExtProcServer(
        lambda: router,
        lambda: snapshot,
        options=ServerOptions(port=port, reuse_port=reuse_port, grace_seconds=5.0),
    )
    asyncio.run(server.run_until_signalled())
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1)
    arguments = parser.parse_args()
    return run_in_workers(arguments.workers, serve, (arguments.port, arguments.workers > 1))


if __name__ == "__main__":
    sys.exit(main())
