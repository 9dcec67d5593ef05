"""Shared helpers for the policy tests: write a policy, build pods, decide."""

from __future__ import annotations

import random
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policyd.policy import PolicyError, PolicySet, Request, Router
from policyd.policy.loader import load_policy_set
from policyd.pool.pod import Pod

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "rules"


def write(tmp_path: Path, text: str, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def policy_set(tmp_path: Path, text: str, name: str = "policy.yaml") -> PolicySet:
    return load_policy_set(write(tmp_path, text, name))


def router(tmp_path: Path, text: str, seed: int = 0) -> Router:
    return Router(policy_set(tmp_path, text), rng=random.Random(seed))


def problems(tmp_path: Path, text: str, name: str = "policy.yaml") -> list[str]:
    """Every diagnostic of an invalid policy, as printed (``file:line:col: ...``)."""
    path = write(tmp_path, text, name)
    try:
        load_policy_set(path)
    except PolicyError as error:
        return [str(d).replace(str(tmp_path) + "/", "") for d in error.diagnostics]
    raise AssertionError("the policy loaded without errors")


def warnings(tmp_path: Path, text: str) -> list[str]:
    loaded = policy_set(tmp_path, text)
    return [str(d).replace(str(tmp_path) + "/", "") for d in loaded.warnings]


_ADDRESSES: dict[str, str] = {}


def _address(name: str) -> str:
    """The same address for the same name, a different one for every other name."""
    count = len(_ADDRESSES)
    return _ADDRESSES.setdefault(name, f"10.0.{count // 250}.{count % 250 + 1}:8000")


def pod(name: str, **fields: Any) -> Pod:
    fields.setdefault("address", _address(name))
    return Pod(name=name, **fields)


def request(model: str = "m", headers: Mapping[str, str] | None = None, **fields: Any) -> Request:
    return Request(model=model, headers=dict(headers or {}), **fields)
