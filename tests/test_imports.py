"""The top-level package names `engine`, `kernels`, `router`, `proto` also exist on PyPI;
these must resolve to this repository."""
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "name", ["engine", "kernels", "kvtransfer", "proto", "prefill_node", "decode_node", "router"]
)
def test_package_resolves_inside_repo(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__file__ is not None, f"{name} is a namespace package, not ours"
    assert Path(module.__file__).resolve().parent == REPO / name
