"""IBM Granite 3.x tool calls (vLLM's `granite`): a JSON list of calls after `<|tool_call|>`
(Granite 3.1+ may write `<tool_call>`); a bare list at the very start of the output counts
too (the marker is a special token, which a decode that skips special tokens drops):

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
"""

from __future__ import annotations

from typing import Any

from router.parsers.tools.base import register_tool_parser
from router.parsers.tools.stream import WS, Gen, StreamingToolParser
from router.parsers.tools.tags import quoted, tag, triggered_tags
from router.parsers.tools.types import FunctionTool

MARKER = "<|tool_call|>"


@register_tool_parser("granite")
class GraniteToolParser(StreamingToolParser):
    MARKERS = (MARKER, "<tool_call>")

    def parse(self, mark: int | None = None) -> Gen[None]:
        self.bound(0)
        yield from self.run(WS)
        if (yield from self.peek()) == "[":
            if (yield from self.call_list(0)):
                mark = yield from self.gap()
        else:
            self.release(0)  # the leading whitespace is content
        yield from super().parse(mark)

    def block(self, mark: int) -> Gen[bool | None]:
        self.pos = self.scan(self._starts)
        return (yield from self.call_list(mark))

    @classmethod
    def structural_tag(cls, tools: list[FunctionTool]) -> dict[str, Any] | None:
        return triggered_tags(
            [MARKER],
            [tag(f'{MARKER}[{{"name": {quoted(t.name)}, "arguments": ', t, "}]") for t in tools],
        )
