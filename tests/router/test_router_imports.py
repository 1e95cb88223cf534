"""router/'s own modules (sub-packages included) import one way: no circle, counting imports
inside functions too (read with `ast`; nothing is imported)."""

import ast
import gc
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[2] / "router"


def _modules() -> dict[str, Path]:
    """Every module of router/, by dotted name below `router.` (`http.app`, `dispatch`)."""
    out = {}
    for path in ROUTER.rglob("*.py"):
        parts = path.relative_to(ROUTER).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and not parts[-1].endswith("_pb2"):
            out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The router modules `path` (module `name`) imports, at any depth of its code; `from
    router.x import y` counts `x.y` where that is a module, else `x`."""
    out = set()
    package = name.rsplit(".", 1)[0] if "." in name else ""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "router":
                continue
            base = ".".join(parts[1:])
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                out.add(sub if sub in modules else base)
        elif isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = ".".join(filter(None, [package, node.module or ""]))
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                out.add(sub if sub in modules else base)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("router."))
    return out & modules


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_cycle_finder_sees_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_router_modules_import_one_way():
    paths = _modules()
    modules = set(paths)
    assert {"http.app", "server", "dispatch"} <= modules
    # Garbage earlier tests left (asyncio tasks destroyed while pending) is finalized now,
    # not inside ast.parse: in the full suite, Python code run during CPython 3.11.7's AST
    # construction made it raise a spurious "SystemError: AST constructor recursion depth
    # mismatch" (cpython gh-106905 and its kin).
    gc.collect()
    graph = {m: _imports(p, m, modules) - {m} for m, p in paths.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


_ROUTER_PROCESS = """
import json, sys
import pdserve.cli, router.http.app, router.cli, router.server
from router.http.app import create_app
from router.config import RouterConfig
from router.http.auth import resolve_keys
from router.server import RouterServices, load_model_card

config = RouterConfig(etcd="127.0.0.1:1")
create_app(RouterServices(config, load_model_card(config), resolve_keys(config, {})))
print(json.dumps([m for m in ("torch", "triton", "xgrammar", "numpy") if m in sys.modules]))
"""


def test_router_process_loads_no_torch():
    """What `pdserve router` imports before it serves — the CLI, the model card of the
    default model (tokenizer, chat template), the services and the app — loads neither
    torch, triton nor xgrammar (grammars compile in a child process): a router is light (import
    time and RSS in docs/architecture.md)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _ROUTER_PROCESS],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROUTER.parent,
    )
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.strip().splitlines()[-1]
    assert not {"torch", "triton", "xgrammar"} & set(json.loads(loaded)), (
        loaded
    )  # grammars compile in a child
