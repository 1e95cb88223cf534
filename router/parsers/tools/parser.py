"""Choosing a tool-call parser by name (vLLM's `--tool-call-parser NAME`) and loading plugin
parsers (`--tool-parser-plugin FILE`). The contract every parser keeps is ToolParser's
(router/parsers/tools/base.py, re-exported here with `register_tool_parser`, which plugins use).

The built-in parsers are registered on import of this module, before any plugin can be
loaded, so a plugin's class for a built-in's name replaces the built-in."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from router.parsers.tools import builtin
from router.parsers.tools.base import _PARSERS, ToolParser, register_tool_parser

del builtin  # imported for its effect: the built-in parsers registered themselves
__all__ = ["ToolParser", "load_tool_parser_plugin", "register_tool_parser", "tool_parser",
           "tool_parser_names"]


def tool_parser(name: str) -> type[ToolParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r} (known: "
                         f"{', '.join(sorted(_PARSERS))})") from None


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def load_tool_parser_plugin(path: str) -> None:
    """Imports a Python file whose classes register themselves (`register_tool_parser`)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--tool-parser-plugin {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"pdserve_tool_plugin_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ValueError(f"--tool-parser-plugin {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
