"""The tool-call parser contract, and the registry parsers add themselves to
(`register_tool_parser`: router/parsers/registry.py); router/parsers/tools/parser.py selects
from it by name.

A parser reads one completion's answer text as it streams and splits it into plain content
and function calls, in the model family's own format. Contract, for every parser:
- `feed(text)` returns what `text` adds; `finish()` (once, at the end) what was still held.
  The non-streamed result is `feed(whole text)` then `finish()`, and feeding the same text in
  any pieces gives the same content and the same calls (tests/router/test_tool_parsers.py
  checks every parser this way).
- It holds back only text that may still turn out to be part of a call (a marker's prefix,
  an unfinished call); everything else goes out as content at once.
- It never announces a call it would later take back: a call's `id` and `name` go out once
  the name is complete and names one of the request's tools; then its arguments, in pieces,
  only while they are a valid prefix of a JSON object. Text that only looked like a call
  (a name that is no tool, malformed JSON before the name) goes out as content. A call whose
  arguments break off (the output ended, or the text stops being JSON) is finished as far as
  it was valid; `broken` then says so (the response's calls are what the model wrote).
- Its work is linear in the text, however it is cut (parsers run on the router's event loop,
  and a model can be made to write a call that never ends): it never re-reads, on a later
  piece, text it read before. The built-in parsers also cap one call's text
  (`StreamingToolParser.MAX_CALL_CHARS`: past it, the rest of the output is content).
- `structural_tag(tools)`: the xgrammar structural tag (a dict) that makes this format's
  calls valid by construction under `tool_choice` "auto": text is free until a call marker,
  then the call follows the named tool's schema. None when the format has no such marker.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from router.parsers.registry import ParserRegistry
from router.parsers.tools.types import FunctionTool, ParsedDelta


class ToolParser(ABC):
    name: ClassVar[str]

    def __init__(self, tools: list[FunctionTool]) -> None:
        self.tools = {t.name: t for t in tools}
        self.broken = False  # a call's text stopped being valid before it ended

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """What `text` (the next piece of the answer) adds: content and call pieces."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The end of the output: what was held back (content, or the end of a call)."""

    @classmethod
    def structural_tag(cls, tools: list[FunctionTool]) -> dict[str, Any] | None:
        return None


TOOL_PARSERS: ParserRegistry[type[ToolParser]] = ParserRegistry("tool call", "--tool-parser-plugin")
register_tool_parser = TOOL_PARSERS.register
"""Class decorator: `--tool-call-parser name` selects the class (a plugin file uses this
too). A second class for a name replaces the first (a plugin may override a built-in)."""
