"""The ``policyd serve`` flags of prefix-cache matching, and the settings made of them.

A command calls ``add_arguments(parser)`` when it builds its parser and
``settings_from_arguments(arguments)`` when it runs (``ValueError`` says what
is wrong). Matching costs nothing until a policy reads ``pod.prefix_match``
or ``pod.prefix_tokens``, so it is always on; the flags choose how.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Final, Literal

from policyd.prefix.tokenizers import Tokenizer, tokenizer_from_spec

Mode = Literal["approximate", "precise"]
MODES: Final[tuple[Mode, ...]] = ("approximate", "precise")
DEFAULT_BLOCK_SIZE: Final = 16  # vLLM's default KV block size, in tokens
# Per pod, when the pod does not publish its KV capacity: about one L4's worth
# of a 7-8B model's KV cache (vLLM's num_gpu_blocks there is 700-1500).
DEFAULT_CACHE_BLOCKS: Final = 1024
DEFAULT_KV_EVENTS_PORT: Final = 5557  # vLLM's kv-events publisher endpoint, tcp://*:5557


@dataclass(frozen=True, slots=True)
class PrefixSettings:
    """How policyd matches prompts against the pods' prefix caches."""

    mode: Mode = "approximate"
    tokenizer: str = "estimate"
    block_size: int = DEFAULT_BLOCK_SIZE
    cache_blocks: int = 0  # per pod; 0: the pod's own (vllm:cache_config_info), else the default
    kv_events_port: int = DEFAULT_KV_EVENTS_PORT
    kv_replay_port: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--prefix-index must be one of {', '.join(MODES)}")
        if self.block_size <= 0:
            raise ValueError("--prefix-block-size must be positive")
        if self.cache_blocks < 0:
            raise ValueError("--prefix-cache-blocks must not be negative")
        for flag, port in (
            ("--kv-events-port", self.kv_events_port),
            ("--kv-events-replay-port", self.kv_replay_port),
        ):
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{flag} must be from 1 to 65535, not {port}")

    def make_tokenizer(self) -> Tokenizer:
        """The tokenizer named (``ValueError`` for an unknown one or an unreadable file)."""
        return tokenizer_from_spec(self.tokenizer)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefix-cache matching (docs/prefix-cache.md)")
    group.add_argument(
        "--prefix-index",
        choices=MODES,
        default="approximate",
        help="approximate: learn from policyd's own routing; precise: from the pods' "
        "KV-cache events (default approximate)",
    )
    group.add_argument(
        "--prefix-tokenizer",
        metavar="SPEC",
        default="estimate",
        help="estimate (no vocabulary), sim (the simulated pods'), or hf:PATH "
        "(a model's tokenizer.json or its directory; its chat template is read beside it);"
        " default estimate",
    )
    group.add_argument(
        "--prefix-block-size",
        type=int,
        metavar="TOKENS",
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per KV block, as the pods use (default {DEFAULT_BLOCK_SIZE})",
    )
    group.add_argument(
        "--prefix-cache-blocks",
        type=int,
        metavar="N",
        default=0,
        help="approximate mode: blocks remembered per pod (default: the pod's own "
        f"num_gpu_blocks when it publishes it, else {DEFAULT_CACHE_BLOCKS})",
    )
    group.add_argument(
        "--kv-events-port",
        type=int,
        metavar="PORT",
        default=DEFAULT_KV_EVENTS_PORT,
        help=f"precise mode: each pod's KV-event publisher port (default {DEFAULT_KV_EVENTS_PORT})",
    )
    group.add_argument(
        "--kv-events-replay-port",
        type=int,
        metavar="PORT",
        help="precise mode: each pod's replay port, to recover missed events (default: none; "
        "a gap clears that pod's entries instead)",
    )


def settings_from_arguments(arguments: argparse.Namespace) -> PrefixSettings:
    return PrefixSettings(
        mode=arguments.prefix_index,
        tokenizer=arguments.prefix_tokenizer,
        block_size=arguments.prefix_block_size,
        cache_blocks=arguments.prefix_cache_blocks,
        kv_events_port=arguments.kv_events_port,
        kv_replay_port=arguments.kv_events_replay_port,
    )
