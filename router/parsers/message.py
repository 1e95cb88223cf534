"""One chat completion's text as a message: reasoning, answer content and tool calls.

`OutputSetup` is what a request asked for (its tools and `tool_choice`, the server's parsers);
`MessageParser` reads one completion's text with it, streamed or whole (the same result
either way: a non-streamed message is `feed(text)` then `finish()`). How the calls are read
depends on `tool_choice`:
- "auto": the server's --tool-call-parser reads the model's own call format;
- a named function: the output is that function's arguments (the grammar makes it a JSON
  object of the tool's schema), so the whole answer is one call;
- "required": the output is a JSON array of `{"name", "parameters"}` objects (the grammar
  makes it one), each a call;
- "none" (or no tools): the answer is content.
With a reasoning parser, the text before the end of reasoning is `reasoning` and only the
answer after it is read for calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from router.parsers.reasoning.parser import ReasoningParser
from router.parsers.tools.parser import ToolParser
from router.parsers.tools.stream import Gen, StreamingToolParser
from router.parsers.tools.types import (
    FunctionTool,
    ParsedDelta,
    ToolCallDelta,
    new_call_id,
)

ToolChoice = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class ChatOptions:
    """How this server reads chat output (the router's flags, resolved at start)."""

    auto_tool_choice: bool = False
    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None
    reasoning_markers: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """The reasoning parser's start and end markers as token ids: a structured-output
    constraint binds the answer only, after the end marker (engine/structured/gate.py)."""


@dataclass(frozen=True)
class OutputSetup:
    """What one chat request's output is read for."""

    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = "none"
    named: str | None = None  # tool_choice "function": the function's name
    parallel_tool_calls: bool = True
    parser: type[ToolParser] | None = None  # tool_choice "auto"
    reasoning: type[ReasoningParser] | None = None
    prompt_ends_reasoning: bool = False  # the rendered prompt closed the reasoning
    prompt_starts_reasoning: bool = False  # the rendered prompt opened it (output thinks first)
    include_reasoning: bool = True

    @property
    def calls_end_with_tool_calls(self) -> bool:
        """A completion that called tools finishes with "tool_calls" (OpenAI: not for a
        named function, which finishes with "stop")."""
        return self.tool_choice in ("auto", "required")


class MessageParser:
    def __init__(self, setup: OutputSetup) -> None:
        self.setup = setup
        self._reasoning = (
            setup.reasoning(setup.prompt_ends_reasoning, setup.prompt_starts_reasoning)
            if setup.reasoning is not None
            else None
        )
        self._calls = _call_reader(setup)
        self._num_calls = 0

    @property
    def called_tools(self) -> bool:
        return self._num_calls > 0

    @property
    def num_calls(self) -> int:
        """Calls announced so far."""
        return self._num_calls

    def feed(self, text: str) -> ParsedDelta:
        if self._reasoning is None:
            return self._answer(text, final=False)
        split = self._reasoning.feed(text)
        return self._out(split.reasoning, self._answer(split.content, final=False))

    def finish(self) -> ParsedDelta:
        if self._reasoning is None:
            return self._answer("", final=True)
        split = self._reasoning.finish()
        return self._out(split.reasoning, self._answer(split.content, final=True))

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The choice's finish_reason: "tool_calls" for a completion that stopped after
        calling tools (auto / required)."""
        if engine_reason == "stop" and self.called_tools and self.setup.calls_end_with_tool_calls:
            return "tool_calls"
        return engine_reason

    def _out(self, reasoning: str, answer: ParsedDelta) -> ParsedDelta:
        if self.setup.include_reasoning:
            answer.reasoning = reasoning + answer.reasoning
        return answer

    def _answer(self, text: str, final: bool) -> ParsedDelta:
        if self._calls is None:
            return ParsedDelta(content=text)
        out = self._calls.feed(text) if text else ParsedDelta()
        if final:
            out.extend(self._calls.finish())
        self._num_calls += sum(1 for d in out.tool_calls if d.name is not None)
        return out


def _call_reader(setup: OutputSetup) -> ToolParser | None:
    if setup.tool_choice == "auto" and setup.parser is not None:
        return setup.parser(list(setup.tools))
    if setup.tool_choice == "function":
        return NamedCallReader(list(setup.tools), setup.named or "")
    if setup.tool_choice == "required":
        return RequiredCallsReader(list(setup.tools))
    return None


class NamedCallReader(ToolParser):
    """tool_choice naming a function: the whole answer is that call's arguments."""

    name = "named"

    def __init__(self, tools: list[FunctionTool], function: str) -> None:
        super().__init__(tools)
        self.function = function
        self._announced = False

    def feed(self, text: str) -> ParsedDelta:
        if self._announced:
            return ParsedDelta(tool_calls=[ToolCallDelta(0, arguments=text)])
        self._announced = True
        return ParsedDelta(tool_calls=[ToolCallDelta(0, new_call_id(), self.function, text)])

    def finish(self) -> ParsedDelta:
        return ParsedDelta()  # no text at all: no call (an empty arguments string is none)


class RequiredCallsReader(StreamingToolParser):
    """tool_choice "required": the answer is a JSON array of {"name", "parameters"} objects
    (the constraint, `required_calls_schema`, makes it one), read as the other JSON formats
    are: each call announced once its parameters begin, then streamed."""

    MARKERS = ("[",)

    def block(self, mark: int) -> Gen[bool | None]:
        return (yield from self.call_list(mark))


def required_calls_schema(tools: list[FunctionTool], parallel: bool) -> dict:
    """The JSON schema tool_choice "required" constrains the output to: a non-empty array
    (one element when parallel_tool_calls is false) of calls to the request's tools, each
    with arguments valid against its tool's schema."""
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.name]},
                    "parameters": t.parameters or {"type": "object"},
                },
                "required": ["name", "parameters"],
            }
            for t in tools
        ]
    }
    schema = {"type": "array", "minItems": 1, "items": call}
    if not parallel:
        schema["maxItems"] = 1
    return schema
