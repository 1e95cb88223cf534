"""The tooling the README's test command runs, configured in pyproject.toml: ruff's linter
(pyflakes, pycodestyle, import order, lines of at most 100 characters) and its formatter over
the repository, mypy over the libraries and services. Each must report nothing.

The tools come from the test extra (`pip install -e '.[test]'`) and are run from the same
environment as pytest (next to `sys.executable`); where one is not installed its test skips.
mypy keeps its cache in .mypy_cache/ (gitignored): a cold run takes about a minute on 2 cores,
a warm one, with few files changed, seconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Not resolved: the venv's python is a symlink to the base interpreter, its tools are not.
BIN = Path(sys.executable).parent
MAX_LINES = 300  # of a tool's output in a failure message


def _run(tool: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    path = BIN / tool
    if not path.is_file():
        pytest.skip(
            f"{tool} is not installed next to {sys.executable} "
            "(pip install -e '.[test]' installs the pinned version)"
        )
    return subprocess.run(
        [str(path), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def _assert_clean(proc: subprocess.CompletedProcess[str], fix: str) -> None:
    if proc.returncode == 0:
        return
    lines = (proc.stdout + proc.stderr).splitlines()
    shown = lines[:MAX_LINES] + (
        [f"... {len(lines) - MAX_LINES} more lines"] if len(lines) > MAX_LINES else []
    )
    command = " ".join([Path(proc.args[0]).name, *proc.args[1:]])
    pytest.fail(
        f"`{command}` exited {proc.returncode} ({fix}):\n" + "\n".join(shown), pytrace=False
    )


def test_ruff_lint_is_clean() -> None:
    _assert_clean(
        _run("ruff", "check", "--no-fix", "--output-format", "concise", ".", timeout_s=120),
        "`ruff check --fix .` sorts imports; wrap long lines by hand",
    )


def test_ruff_format_is_clean() -> None:
    _assert_clean(
        _run("ruff", "format", "--check", "--output-format", "concise", ".", timeout_s=120),
        "`ruff format .` rewrites the files it names",
    )


def test_mypy_is_clean() -> None:
    # The files and settings are [tool.mypy]'s; it checks against this interpreter's packages.
    _assert_clean(
        _run("mypy", "--python-executable", sys.executable, timeout_s=600),
        "see [tool.mypy] in pyproject.toml for what it checks",
    )
