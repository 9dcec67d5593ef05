"""The hot path runs compiled, as ``make`` builds it, and never from a stale build.

``make install`` compiles the modules listed under ``[tool.policyd] compiled``
in ``pyproject.toml`` with mypyc, in place (``setup.py``). A compiled module
is imported instead of its source, so one built before the source last
changed would run old code; ``make`` rebuilds it, and this says so when a
run did not go through ``make``.
"""

from __future__ import annotations

import importlib
import tomllib
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPILED = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["policyd"]["compiled"]


def test_the_compiled_list_names_existing_modules() -> None:
    assert COMPILED, "nothing is listed as compiled"
    for path in COMPILED:
        assert (REPO / path).is_file(), path


@pytest.mark.parametrize("path", COMPILED)
def test_module_is_loaded_compiled_and_built_from_its_current_source(path: str) -> None:
    # A compiled module's __file__ has the extension's suffix, but its folder
    # is not always right (mypyc works it out from the shared library's when
    # another compiled module imports it first): the build is looked up by name.
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    assert str(module.__file__).endswith(EXTENSION_SUFFIXES[0]), (
        f"{path} runs interpreted ({module.__file__}): run `make install`"
    )
    built = REPO / (path.removesuffix(".py") + EXTENSION_SUFFIXES[0])
    assert built.stat().st_mtime >= (REPO / path).stat().st_mtime, (
        f"{built.name} is older than {path}: run `make install` to rebuild it"
    )
