"""Choosing a tool-call parser by name (vLLM's `--tool-call-parser NAME`) and loading plugin
parsers (`--tool-parser-plugin FILE`). The contract every parser keeps is ToolParser's
(router/parsers/tools/base.py, re-exported here with `register_tool_parser`, which plugins use).

The built-in parsers are registered on import of this module, before any plugin can be
loaded, so a plugin's class for a built-in's name replaces the built-in."""

from __future__ import annotations

from router.parsers.tools import builtin
from router.parsers.tools.base import TOOL_PARSERS, ToolParser, register_tool_parser

del builtin  # imported for its effect: the built-in parsers registered themselves
__all__ = [
    "ToolParser",
    "load_tool_parser_plugin",
    "register_tool_parser",
    "tool_parser",
    "tool_parser_names",
]

tool_parser = TOOL_PARSERS.get
tool_parser_names = TOOL_PARSERS.names
load_tool_parser_plugin = TOOL_PARSERS.load_plugin
"""Imports a Python file whose classes register themselves (`register_tool_parser`)."""
