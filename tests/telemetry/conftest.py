"""Fixtures for the telemetry tests; the ext_proc and e2e helpers are shared from their folders."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
for folder in ("extproc", "e2e"):  # EnvoySide, TestUpstream, free_port
    if str(TESTS / folder) not in sys.path:
        sys.path.append(str(TESTS / folder))

from telemetry_support import Spans, in_memory_spans  # noqa: E402


@pytest.fixture
def spans() -> Iterator[Spans]:
    yield from in_memory_spans()
