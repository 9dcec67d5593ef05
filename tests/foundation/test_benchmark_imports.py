"""The scripts of ``benchmarks/`` import each other without a circle.

They import one another by bare name (each script's directory is on its
path), so a circle among them is a module half-built when the other reads it,
and two scripts that cannot be read apart. Imports are read with ``ast``,
those inside functions too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def import_graph(directory: Path) -> dict[str, set[str]]:
    """Each module of ``directory`` -> the modules of ``directory`` it imports."""
    local = {path.stem for path in directory.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(directory.glob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        graph[path.stem] = found & local - {path.stem}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as the modules along it, first repeated last; ``None``
    when it has none (a depth-first walk: a module met again while still on the
    path closes a circle)."""
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(graph.get(module, ())):
            if (circle := walk(imported, [*path, module])) is not None:
                return circle
        done.add(module)
        return None

    for module in sorted(graph):
        if (circle := walk(module, [])) is not None:
            return circle
    return None


def test_the_benchmarks_import_each_other_without_a_circle() -> None:
    graph = import_graph(BENCHMARKS)
    assert "quality" in graph and "virtual_routing" in graph["quality"]  # the graph is read
    circle = find_circle(graph)
    assert circle is None, f"benchmarks/ import circle: {' -> '.join(circle or [])}"


def test_a_circle_through_a_lazy_import_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("from c import x\n")
    (tmp_path / "c.py").write_text("def main() -> None:\n    import a\n")
    (tmp_path / "d.py").write_text("import a\nimport os\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_circle(graph) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("import os\n")
    assert find_circle(import_graph(tmp_path)) is None
