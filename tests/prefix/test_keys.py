"""policyd's chained block keys: what names the same blocks and what does not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from policyd.prefix.keys import block_keys, chain_key, root_key


def test_only_full_blocks_are_keyed_and_equal_prefixes_share_leading_keys() -> None:
    shared = list(range(100, 132))  # two full blocks of 16
    first = block_keys([*shared, *range(500, 520)], 16, "m")  # 52 tokens: 3 full blocks
    second = block_keys([*shared, *range(600, 616)], 16, "m")  # 48 tokens: 3 full blocks
    assert len(first) == 3 and len(second) == 3
    assert first[:2] == second[:2] and first[2] != second[2]
    assert block_keys(shared[:15], 16, "m") == ()
    assert block_keys(shared, 16, "m") == first[:2]


def test_a_key_names_everything_before_its_block() -> None:
    a = block_keys([*range(16), *range(16)], 16, "m")
    b = block_keys([*range(1, 17), *range(16)], 16, "m")
    # The same second block after a different first one is a different block.
    assert a[1] != b[1]
    assert a[1] == chain_key(a[0], tuple(range(16)))
    assert a[0] == chain_key(root_key("m"), tuple(range(16)))


def test_the_model_or_adapter_seeds_the_chain() -> None:
    tokens = list(range(64))
    assert set(block_keys(tokens, 16, "base")).isdisjoint(block_keys(tokens, 16, "adapter-1"))
    assert block_keys(tokens, 16, "base") == block_keys(tuple(tokens), 16, "base")


def test_block_size_cuts_differently_and_must_be_positive() -> None:
    tokens = list(range(64))
    assert len(block_keys(tokens, 32, "m")) == 2
    assert set(block_keys(tokens, 32, "m")).isdisjoint(block_keys(tokens, 16, "m"))
    with pytest.raises(ValueError, match="positive"):
        block_keys(tokens, 0, "m")


def test_keys_do_not_depend_on_the_process_hash_seed() -> None:
    code = "from policyd.prefix.keys import block_keys\nprint(block_keys(range(80), 16, 'a-3'))\n"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1 and len(next(iter(outputs)).split(",")) == 5
