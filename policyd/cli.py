"""The ``policyd`` command line.

Each subcommand lives in the room that owns its job and is imported only when
it runs, so ``policyd check`` does not pay for gRPC and ``policyd sim`` does not
load the policy engine. A command module exposes ``register(name, parser)``,
which adds the arguments and sets ``parser.set_defaults(run=callable)``; the
callable takes the parsed arguments and returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Final

from policyd import __version__

# name -> (module that implements it, one-line help)
COMMANDS: Final[dict[str, tuple[str, str]]] = {
    "serve": (
        "policyd.extproc.serve_command",
        "run the ext_proc service Envoy asks for each request",
    ),
    "demo": (
        "policyd.demo.command",
        "run Envoy + policyd + a simulated vLLM pool and show decisions",
    ),
    "sim": ("policyd.sim.command", "run a pool of simulated vLLM pods on local ports"),
    "envoy-config": (
        "policyd.extproc.envoy_config",
        "print an Envoy bootstrap that routes inference requests through policyd",
    ),
    "check": ("policyd.policy.commands", "validate policy files; errors as file:line:col"),
    "explain": ("policyd.policy.commands", "show why a request would go where it goes"),
    "test": ("policyd.policy.commands", "run the policy unit tests (*.test.yaml)"),
}


def build_parser(selected: str | None) -> argparse.ArgumentParser:
    """The full parser; only the module of ``selected`` is imported."""
    parser = argparse.ArgumentParser(
        prog="policyd",
        description="Routing-policy service for LLM inference behind Envoy (ext_proc).",
    )
    parser.add_argument("--version", action="version", version=f"policyd {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        subparser = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            importlib.import_module(module_name).register(name, subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in arguments if not a.startswith("-")), None)
    parser = build_parser(selected if selected in COMMANDS else None)
    parsed = parser.parse_args(arguments)
    run: Callable[[argparse.Namespace], int] | None = getattr(parsed, "run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return run(parsed)
    except BrokenPipeError:
        return _reader_went_away()


def _reader_went_away() -> int:
    """The exit of a command whose reader closed its output (``policyd explain ... | head``).

    Python ignores SIGPIPE, so a write to a closed pipe raises instead of
    ending the process quietly as other command-line tools end. What is still
    buffered for stdout would raise again at exit: stdout goes to /dev/null.
    The status is the shell's for a process SIGPIPE ended (128 + 13), so
    ``set -o pipefail`` still sees that the output was cut short.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE
