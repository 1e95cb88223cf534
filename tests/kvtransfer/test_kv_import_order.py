"""Imports among kvtransfer's own modules point one way: no module reaches itself again.

Read with `ast`, nothing is imported. Every import counts, including those inside functions
and under `TYPE_CHECKING`: a circle hidden from the interpreter is still a circle.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvtransfer"


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The kvtransfer modules `path` imports; '__init__' for the package's own names."""

    def module_of(dotted: str) -> str | None:
        head, _, rest = dotted.partition(".")
        return None if head != "kvtransfer" else rest.split(".")[0] or "__init__"

    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(module_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import; kvtransfer uses absolute ones"
            if node.module == "kvtransfer":  # `from kvtransfer import base` or a package name
                out.update(a.name if a.name in modules else "__init__" for a in node.names)
            else:
                out.add(module_of(node.module))
    return out - {None, path.stem}


def _graph() -> dict[str, set[str]]:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return {p.stem: _imports(p, modules) for p in PACKAGE.glob("*.py")}


def _find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as [a, b, ..., a], or [] if there is none."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str]:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return []
        for dep in sorted(graph[name]):
            cycle = visit(dep, path + [name])
            if cycle:
                return cycle
        done.add(name)
        return []

    for name in sorted(graph):
        cycle = visit(name, [])
        if cycle:
            return cycle
    return []


def test_no_import_circle_inside_kvtransfer():
    cycle = _find_cycle(_graph())
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_cycle_finder_sees_a_circle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) == []
