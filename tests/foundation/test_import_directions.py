"""The rooms of ``policyd`` import each other only the way docs/architecture.md allows.

Every module's imports are read with ``ast`` (imports inside functions too: a
lazy import is still a dependency), so an import that breaks the rule fails
here instead of quietly eroding the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE_ROOT = Path(__file__).resolve().parents[2]
ROOT = "policyd"  # the package itself: its __init__ holds only __version__

# Room -> what of policyd it may import besides itself: module prefixes, or ROOT
# for the package's own __init__ alone. The "Rooms and the direction of imports"
# table of docs/architecture.md, as code.
ALLOWED: dict[str, tuple[str, ...]] = {
    "fields": (),
    "cel": ("policyd.fields",),
    # The simulated pods tokenize with the router's contract for them; prefix never imports sim.
    "sim": ("policyd.prefix.simulated",),
    "pool": ("policyd.cel.values", "policyd.fields"),
    "policy": ("policyd.cel", "policyd.fields"),
    "telemetry": (
        ROOT,
        "policyd.fields",
        "policyd.policy.decision",
        "policyd.policy.request",
        "policyd.pool.pod",
    ),
    "prefix": ("policyd.fields",),
    "flow": ("policyd.policy",),
    "latency": (
        "policyd.policy.decision",
        "policyd.policy.request",
        "policyd.telemetry.exchange_end",
    ),
    "extproc": (
        "policyd.flow",
        "policyd.latency",
        "policyd.policy",
        "policyd.pool",
        "policyd.prefix",
        "policyd.telemetry",
    ),
    "demo": (
        ROOT,
        "policyd.cel",
        "policyd.extproc",
        "policyd.fields",
        "policyd.flow",
        "policyd.latency",
        "policyd.policy",
        "policyd.pool",
        "policyd.prefix",
        "policyd.sim",
        "policyd.telemetry",
    ),
}


def imported_modules(path: Path, source_root: Path = SOURCE_ROOT) -> set[str]:
    """The policyd modules ``path`` imports, relative imports resolved.

    ``from a import b`` counts as importing ``a.b`` when that is a module, else ``a``.
    """
    package = ".".join(path.relative_to(source_root).parts[:-1])

    def is_module(name: str) -> bool:
        where = source_root.joinpath(*name.split("."))
        return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base)
    return {name for name in found if name == ROOT or name.startswith(ROOT + ".")}


def allowed(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(
        name == prefix or (prefix != ROOT and name.startswith(prefix + ".")) for prefix in prefixes
    )


def test_every_room_is_in_the_table() -> None:
    package = SOURCE_ROOT / ROOT
    rooms = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    assert rooms == set(ALLOWED)


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_a_room_imports_only_what_the_architecture_allows(room: str) -> None:
    prefixes = (f"{ROOT}.{room}", *ALLOWED[room])
    broken = sorted(
        f"{path.relative_to(SOURCE_ROOT)} imports {name}"
        for path in (SOURCE_ROOT / ROOT / room).rglob("*.py")
        for name in imported_modules(path)
        if not allowed(name, prefixes)
    )
    assert broken == []


def test_the_reader_sees_lazy_relative_and_root_imports(tmp_path: Path) -> None:
    for module in ("__init__.py", "sim/__init__.py", "cel/__init__.py", "cel/values.py"):
        (tmp_path / ROOT / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / ROOT / module).write_text("")
    module = tmp_path / ROOT / "sim" / "engine.py"
    module.write_text(
        "from policyd import __version__\n"
        "def f():\n"
        "    from ..cel import values\n"
        "    import policyd.pool.pod\n"
        "    import json\n"
    )
    found = imported_modules(module, tmp_path)
    assert found == {"policyd", "policyd.cel.values", "policyd.pool.pod"}
    assert not allowed("policyd.cel.values", (ROOT,))  # the root allows nothing below it
    assert allowed("policyd", (ROOT,))
    assert allowed("policyd.cel.values", ("policyd.cel",))
    assert not allowed("policyd.celery", ("policyd.cel",))
