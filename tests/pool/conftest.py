"""Fixtures shared by the pool tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .model_server import MetricsServer


@pytest.fixture
async def servers() -> AsyncIterator[list[MetricsServer]]:
    """Model servers a test starts; stopped when it ends."""
    started: list[MetricsServer] = []
    yield started
    for server in started:
        await server.stop()
