"""The scripts of benchmarks/ as modules, for the tests that check their wiring."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Final

BENCHMARKS: Final = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """A module of benchmarks/, imported as the scripts there import each other (each
    other's names resolve while it loads, from that folder)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
