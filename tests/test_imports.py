"""Top-level packages: where they resolve, and which way their imports point.

The top-level package names `engine`, `kernels`, `router`, `proto` (and others) also exist on
PyPI; these must resolve to this repository. The import direction (docs/architecture.md) is
checked by parsing every module with `ast` — nothing is imported — so lazy imports inside
functions and `__import__("pkg.mod")` count as much as the ones at the top of a file."""
import ast
import importlib
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
    ["benchmarks"],
    ["pdserve"],  # the command line
]
PACKAGES = [name for layer in LAYERS for name in layer]
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}
LIBRARIES = ["engine", "kernels", "kvtransfer", "proto"]
SERVICES = {"cluster", "worker_runtime", "prefill_node", "decode_node", "router", "local_cluster", "pdserve"}


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
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Name, ast.Attribute))
            and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("__import__", "import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.lineno, node.args[0].value))
    return out


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


def test_no_import_cycle_between_top_level_packages() -> None:
    graph = _package_imports()
    state: dict[str, str] = {}  # visiting | done

    def visit(name: str, path: list[str]) -> None:
        state[name] = "visiting"
        for dep in sorted(graph[name]):
            if state.get(dep) == "visiting":
                stack = path + [name]
                cycle = stack[stack.index(dep):] + [dep]
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
        if LAYER_OF[dep] > LAYER_OF[name] or (LAYER_OF[dep] == LAYER_OF[name] and name not in LIBRARIES)
        for where in wheres
    ]
    assert not wrong, "imports not pointing down a layer:\n  " + "\n  ".join(wrong)


@pytest.mark.parametrize("name", LIBRARIES)
def test_libraries_import_no_service(name: str) -> None:
    bad = {dep: where for dep, where in _package_imports()[name].items() if dep in SERVICES}
    assert not bad, f"{name} imports service packages: " + "; ".join(w for ws in bad.values() for w in ws)
