"""Mistral tool calls (vLLM's `mistral`), in both of the family's forms:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{...}

The first is the older tokenizers' (up to v7); the second is v11+'s, where `[CALL_ID]id`
may come before `[ARGS]`, and a decode that skips special tokens leaves out `[ARGS]`."""

from __future__ import annotations

import re
from typing import Any

from router.parsers.tools.base import register_tool_parser
from router.parsers.tools.stream import Gen, StreamingToolParser
from router.parsers.tools.tags import quoted, tag, triggered_tags
from router.parsers.tools.types import FunctionTool

MARKER = "[TOOL_CALLS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_CALL_ID = re.compile(r"[A-Za-z0-9]*")


@register_tool_parser("mistral")
class MistralToolParser(StreamingToolParser):
    MARKERS = (MARKER,)

    def block(self, mark: int) -> Gen[bool | None]:
        self.pos += len(MARKER)
        first = yield from self.peek_after_ws()
        if first == "[":
            return (yield from self.call_list(mark))
        if first == "{":
            return (yield from self.json_call(mark))
        return (yield from self._named_call(mark))

    def _named_call(self, mark: int) -> Gen[bool | None]:
        """`name[CALL_ID]id[ARGS]{...}` at `pos` (the call id and `[ARGS]` optional)."""
        name = yield from self.run(_NAME)
        if (yield from self.literal("[CALL_ID]")):
            yield from self.run(_CALL_ID)
        yield from self.literal("[ARGS]")
        if name not in self.tools or (yield from self.peek()) != "{":
            self.release(mark)
            return None
        return (yield from self.stream_args(self.announce(name)))

    @classmethod
    def structural_tag(cls, tools: list[FunctionTool]) -> dict[str, Any] | None:
        return triggered_tags(
            [MARKER],
            [
                form
                for t in tools
                for form in (
                    tag(f'{MARKER}[{{"name": {quoted(t.name)}, "arguments": ', t, "}]"),
                    tag(f"{MARKER}{t.name}[ARGS]", t, ""),
                )
            ],
        )
