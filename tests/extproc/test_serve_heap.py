"""``policyd serve`` freezes its start-up heap before it serves (``freeze_startup_heap``)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from policyd.cli import main
from policyd.extproc.assembly import Policyd

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_process() -> Iterator[None]:
    """This test process as it was: the command freezes its heap and sets up logging."""
    root, urllib3 = logging.getLogger(), logging.getLogger("urllib3")
    handlers, levels = list(root.handlers), (root.level, urllib3.level)
    gc.unfreeze()
    yield
    gc.unfreeze()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(levels[0])
    urllib3.setLevel(levels[1])


def test_serve_freezes_what_start_up_made_before_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_process: None
) -> None:
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods:\n  - {name: a, address: '127.0.0.1:1'}\n")
    frozen_when_serving: list[int] = []

    async def serve_until_signalled(self: Policyd) -> None:
        frozen_when_serving.append(gc.get_freeze_count())
        # The compiled policy is among what was frozen.
        frozen_when_serving.append(sum(1 for o in gc.get_objects() if o is self.store))

    monkeypatch.setattr(Policyd, "run_until_signalled", serve_until_signalled)
    argv = ["serve", "--policy", str(REPO / "rules" / "default.yaml"), "--pods", str(pods)]
    assert main([*argv, "--port", "0", "--monitoring-port", "0"]) == 0
    frozen, store_still_collected = frozen_when_serving
    assert frozen > 10_000  # modules, descriptors, the policy: tens of thousands of objects
    assert store_still_collected == 0  # frozen objects leave the collector's generations
