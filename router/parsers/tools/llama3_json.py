"""Llama 3.x JSON tool calls (vLLM's `llama3_json`): a JSON object naming the function and
its `parameters` ("arguments" is accepted too), optionally after `<|python_tag|>`; several
are separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

Any `{` in the text may begin a call: text that is no call's JSON goes out as content as soon
as that shows (a `{` not followed by `"name"` shows it at its next character)."""

from __future__ import annotations

from typing import Any

from router.parsers.tools.base import register_tool_parser
from router.parsers.tools.stream import Gen, StreamingToolParser
from router.parsers.tools.tags import quoted, tag, triggered_tags
from router.parsers.tools.types import FunctionTool

PYTHON_TAG = "<|python_tag|>"


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(StreamingToolParser):
    MARKERS = (PYTHON_TAG, "{")
    SEPARATOR = ";"

    def block(self, mark: int) -> Gen[bool | None]:
        if self.ahead(len(PYTHON_TAG)) == PYTHON_TAG:
            self.pos += len(PYTHON_TAG)
        return (yield from self.json_call(mark))

    @classmethod
    def structural_tag(cls, tools: list[FunctionTool]) -> dict[str, Any] | None:
        return triggered_tags(
            ['{"name": '],
            [tag(f'{{"name": {quoted(t.name)}, "parameters": ', t, "}") for t in tools],
        )
