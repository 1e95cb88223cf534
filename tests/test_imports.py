"""Top-level packages: where they resolve, and which way their imports point.

The top-level package names `engine`, `kernels`, `router`, `proto` (and others) also exist on
PyPI; these must resolve to this repository. The import direction (docs/architecture.md) is
checked by parsing every module with `ast` — nothing is imported — so lazy imports inside
functions and `__import__("pkg.mod")` count as much as the ones at the top of a file. The same
parse finds cycles between modules, inside a package too; an `if TYPE_CHECKING:` import counts
unless it is listed in TYPE_ONLY_CYCLE_EDGES."""

import ast
import importlib
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Lowest first; a package imports only from the layers below its own (libraries also from each
# other, without a cycle). docs/architecture.md states the same rule.
LAYERS = [
    ["kernels"],
    ["engine", "kvtransfer", "proto"],  # libraries: no network service code
    ["cluster"],  # etcd registration/discovery, what workers and router share
    ["worker_runtime"],  # what both worker roles share
    ["prefill_node", "decode_node", "router", "local_cluster"],  # services, `pdserve up`
    ["pdserve"],  # the command line (`pdserve bench`, `pdserve chaos` too)
]
PACKAGES = [name for layer in LAYERS for name in layer]
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}
LIBRARIES = ["engine", "kernels", "kvtransfer", "proto"]
SERVICES = {
    "cluster",
    "worker_runtime",
    "prefill_node",
    "decode_node",
    "router",
    "local_cluster",
    "pdserve",
}


@pytest.mark.parametrize("name", PACKAGES)
def test_package_resolves_inside_repo(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__file__ is not None, f"{name} is a namespace package, not ours"
    assert Path(module.__file__).resolve().parent == REPO / name


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) for every absolute import, and `__import__`/`import_module` of
    a constant name, anywhere in the module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif (called := _called_import(node)) is not None:
            out.append((node.lineno, called))
    return out


def _called_import(node: ast.AST) -> str | None:
    """The module of `__import__("pkg.mod")` / `import_module("pkg.mod")`, else None."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, (ast.Name, ast.Attribute))
        and getattr(node.func, "id", getattr(node.func, "attr", None))
        in ("__import__", "import_module")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value
    return None


def _package_imports() -> dict[str, dict[str, list[str]]]:
    """importer -> imported top-level package -> ["path:line module", ...]."""
    graph: dict[str, dict[str, list[str]]] = {name: {} for name in PACKAGES}
    for name in PACKAGES:
        for path in sorted((REPO / name).rglob("*.py")):
            for line, module in _imported_modules(ast.parse(path.read_text(), str(path))):
                top = module.split(".")[0]
                if top in graph and top != name:
                    where = f"{path.relative_to(REPO)}:{line} {module}"
                    graph[name].setdefault(top, []).append(where)
    return graph


def test_every_top_level_package_is_checked() -> None:
    found = {p.parent.name for p in REPO.glob("*/__init__.py")}
    missing = sorted(found - set(PACKAGES))
    assert not missing, f"add {missing} to a layer in LAYERS (and to docs/architecture.md)"


def test_the_wheel_holds_the_layers_and_no_scripts() -> None:
    """benchmarks/ and tools/ hold scripts run by path, outside the wheel: no package there,
    and nothing imports them as one (their tests put the folder on the path, conftest.py)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = setuptools["packages"]["find"]["include"]
    assert sorted(pattern.rstrip("*") for pattern in include) == sorted(PACKAGES)
    assert not [*REPO.glob("benchmarks/**/__init__.py"), *REPO.glob("tools/**/__init__.py")]
    where = [
        f"{path.relative_to(REPO)}:{line} {module}"
        for top in [*PACKAGES, "tests", "benchmarks", "tools"]
        for path in sorted((REPO / top).rglob("*.py"))
        for line, module in _imported_modules(ast.parse(path.read_text(), str(path)))
        if module.split(".")[0] in ("benchmarks", "tools")
    ]
    assert not where, where
    # Run from the tests, a script is a top-level module: its name must be no one else's.
    scripts = {
        p.stem for folder in ("benchmarks", "tools/gpu") for p in (REPO / folder).glob("*.py")
    }
    helpers = {p.stem for p in (REPO / "tests").rglob("*.py") if not p.stem.startswith("test_")}
    assert not scripts & (helpers | set(PACKAGES)), scripts & (helpers | set(PACKAGES))


def test_no_import_cycle_between_top_level_packages() -> None:
    graph = _package_imports()
    state: dict[str, str] = {}  # visiting | done

    def visit(name: str, path: list[str]) -> None:
        state[name] = "visiting"
        for dep in sorted(graph[name]):
            if state.get(dep) == "visiting":
                stack = path + [name]
                cycle = stack[stack.index(dep) :] + [dep]
                edges = [graph[a][b][0] for a, b in zip(cycle, cycle[1:])]
                pytest.fail(f"import cycle {' -> '.join(cycle)}:\n  " + "\n  ".join(edges))
            if dep not in state:
                visit(dep, path + [name])
        state[name] = "done"

    for name in PACKAGES:
        if name not in state:
            visit(name, [])


def test_imports_point_down_the_layers() -> None:
    """Only to a lower layer; within one layer only among the libraries (the roles, the
    router and `pdserve up` never import each other)."""
    wrong = [
        where
        for name, deps in _package_imports().items()
        for dep, wheres in deps.items()
        if LAYER_OF[dep] > LAYER_OF[name]
        or (LAYER_OF[dep] == LAYER_OF[name] and name not in LIBRARIES)
        for where in wheres
    ]
    assert not wrong, "imports not pointing down a layer:\n  " + "\n  ".join(wrong)


@pytest.mark.parametrize("name", LIBRARIES)
def test_libraries_import_no_service(name: str) -> None:
    bad = {dep: where for dep, where in _package_imports()[name].items() if dep in SERVICES}
    assert not bad, f"{name} imports service packages: " + "; ".join(
        w for ws in bad.values() for w in ws
    )


# Type-only imports (`if TYPE_CHECKING:`) allowed to close a cycle between modules, each with
# the reason it is the only way. None today: a type lives in the module that owns it, and a
# part gets the parts it uses (or a Protocol of them) rather than its owner.
TYPE_ONLY_CYCLE_EDGES: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under an `if TYPE_CHECKING:` (or `if typing.TYPE_CHECKING:`)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return inside


def _module_imports() -> dict[str, dict[str, list[tuple[str, bool]]]]:
    """importer -> imported product module -> [("path:line", type only), ...], for every
    import anywhere in a module (relative ones resolved). `from pkg import name` points at
    `pkg.name` where that is a module, else at `pkg`; a module importing a package it is
    inside (its `__init__`) is no edge."""
    paths = {
        _module_name(path): path
        for name in PACKAGES
        for path in sorted((REPO / name).rglob("*.py"))
    }
    graph: dict[str, dict[str, list[tuple[str, bool]]]] = {m: {} for m in paths}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        type_only = _type_checking_nodes(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            elif (called := _called_import(node)) is not None:
                targets = [called]
            for target in targets:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != module and not module.startswith(target + "."):
                    where = f"{path.relative_to(REPO)}:{node.lineno}"
                    graph[module].setdefault(target, []).append((where, id(node) in type_only))
    return graph


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, deps = work[-1]
            dep = next(deps, None)
            if dep is not None:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(edges[dep]))))
                elif dep in on_stack:
                    low[node] = min(low[node], index[dep])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_modules() -> None:
    """Lazy imports count; a type-only import counts unless TYPE_ONLY_CYCLE_EDGES lists it."""
    graph = _module_imports()
    edges = {
        m: {
            dep
            for dep, wheres in deps.items()
            if not ((m, dep) in TYPE_ONLY_CYCLE_EDGES and all(type_only for _, type_only in wheres))
        }
        for m, deps in graph.items()
    }
    problems = []
    for component in _cycles(edges):
        inside = [
            f"{a} -> {b} ({graph[a][b][0][0]}{', type only' if graph[a][b][0][1] else ''})"
            for a in component
            for b in sorted(edges[a] & set(component))
        ]
        problems.append(" <-> ".join(component) + ":\n    " + "\n    ".join(inside))
    assert not problems, "import cycles between modules:\n  " + "\n  ".join(problems)


def test_listed_type_only_imports_still_close_a_cycle() -> None:
    """Each TYPE_ONLY_CYCLE_EDGES entry is a type-only import that a cycle needs; drop it
    from the list once it is gone."""
    graph = _module_imports()
    full = {m: set(deps) for m, deps in graph.items()}
    in_cycle = {m for component in _cycles(full) for m in component}
    stale = [
        f"{a} -> {b}"
        for a, b in TYPE_ONLY_CYCLE_EDGES
        if b not in graph.get(a, {}) or not all(t for _, t in graph[a][b]) or not {a, b} <= in_cycle
    ]
    assert not stale, "not (or no longer) a type-only import closing a cycle: " + ", ".join(stale)


def test_the_cycle_check_sees_lazy_relative_and_type_only_imports(tmp_path, monkeypatch) -> None:
    """The module graph on a hand-made package: a lazy import, a relative one and a
    type-only one all make edges, and a cycle through them is found."""
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from cyc import b\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyc.a import f\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ["cyc"])
    graph = _module_imports()
    assert {m: set(d) for m, d in graph.items() if d} == {
        "cyc.a": {"cyc.b"},
        "cyc.b": {"cyc.c"},
        "cyc.c": {"cyc.a"},
    }
    assert graph["cyc.c"]["cyc.a"][0][1] and not graph["cyc.a"]["cyc.b"][0][1]
    assert _cycles({m: set(d) for m, d in graph.items()}) == [["cyc.a", "cyc.b", "cyc.c"]]
