"""Hermes-style tool calls (Hermes 2/3, Qwen2.5, Qwen3; vLLM's `hermes`): each call is a JSON
object between tags, several in a row, text before them is content:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from typing import Any

from router.parsers.tools.base import register_tool_parser
from router.parsers.tools.stream import Gen, StreamingToolParser
from router.parsers.tools.tags import quoted, tag, triggered_tags
from router.parsers.tools.types import FunctionTool

START, END = "<tool_call>", "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(StreamingToolParser):
    MARKERS = (START,)

    def block(self, mark: int) -> Gen[bool | None]:
        self.pos += len(START)
        return bool((yield from self.json_call(mark)) and (yield from self.expect(END)))

    @classmethod
    def structural_tag(cls, tools: list[FunctionTool]) -> dict[str, Any] | None:
        return triggered_tags(
            [START],
            [
                tag(f'{START}\n{{"name": {quoted(t.name)}, "arguments": ', t, f"}}\n{END}")
                for t in tools
            ],
        )
