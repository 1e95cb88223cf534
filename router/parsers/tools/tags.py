"""xgrammar structural tags for the tool formats (`ToolParser.structural_tag`): free text
until a trigger, then one of the tags, each a tool's call whose arguments follow its schema
(xgrammar 0.2.x's `triggered_tags` format)."""

from __future__ import annotations

import json
from typing import Any

from router.parsers.tools.types import FunctionTool


def arguments_schema(tool: FunctionTool) -> dict[str, Any]:
    """The tool's parameters schema; any object when it has none (xgrammar is strict: a bare
    `{"type": "object"}` would allow only `{}`)."""
    if tool.parameters is not None:
        return tool.parameters
    return {"type": "object", "additionalProperties": True}


def tag(begin: str, tool: FunctionTool, end: str) -> dict[str, Any]:
    """`begin`, then the tool's arguments object, then `end`."""
    return {
        "type": "tag",
        "begin": begin,
        "end": end,
        "content": {"type": "json_schema", "json_schema": arguments_schema(tool)},
    }


def triggered_tags(triggers: list[str], tags: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The structural tag: text is free until one of `triggers`, which must go on as one of
    `tags` (each tag's begin starts with one trigger). None without tags (no tools)."""
    if not tags:
        return None
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags},
    }


def quoted(name: str) -> str:
    """A tool name as a JSON string."""
    return json.dumps(name, ensure_ascii=False)
