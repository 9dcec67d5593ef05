"""One end-to-end rig per test module (see ``e2e_rig``).

Envoy starts in well under a second, but there is no need to pay that per test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from e2e_rig import Gateway, start_gateway, stop_gateway


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Gateway]:
    rig = await start_gateway(tmp_path_factory.mktemp("gateway"))
    try:
        yield rig
    finally:
        await stop_gateway(rig)
