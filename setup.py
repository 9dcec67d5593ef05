"""policyd's build; with ``POLICYD_COMPILE=1`` the hot path is compiled with mypyc.

The modules every request runs through (``[tool.policyd] compiled`` in
``pyproject.toml``) are plain, type-checked Python; mypyc turns them into C
extensions that run the same code faster (``benchmarks/cold_cache.py``,
``benchmarks/RESULTS.md``). Everything else stays interpreted.

mypyc compiles from the types it sees, so it must see the real ones of the
libraries those modules use: compile only where policyd's dependencies are
installed. ``make install`` does, in place, once they are
(``POLICYD_COMPILE=1 python setup.py build_ext --inplace``). A plain ``pip
install`` builds in an isolated environment without them, and installs pure
Python, which runs the same code, only slower.
"""

import os
import tomllib
from pathlib import Path

from setuptools import Extension, setup


def extensions() -> list[Extension]:
    if os.environ.get("POLICYD_COMPILE") != "1":
        return []
    from mypyc.build import mypycify  # noqa: PLC0415 (needed only when compiling)

    with (Path(__file__).parent / "pyproject.toml").open("rb") as file:
        modules = tomllib.load(file)["tool"]["policyd"]["compiled"]
    return mypycify(modules, opt_level="3", group_name="policyd.compiled")


setup(ext_modules=extensions())
