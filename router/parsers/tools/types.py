"""The values tool calling passes around: a request's function tools, the calls found in a
model's text, and the pieces of them a stream sends."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FunctionTool:
    """One `{"type": "function", "function": {...}}` entry of a request's `tools`."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema (None: any JSON object)."""
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        """As a chat template expects it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = (
            self.parameters if self.parameters is not None else {"type": "object"}
        )
        return {"type": "function", "function": function}


def new_call_id() -> str:
    """An id for a call the model made (OpenAI's `call_...` shape; vLLM's `chatcmpl-tool-...`
    is accepted back as well: ids are opaque to templates)."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolCall:
    """A complete call: `arguments` is JSON text of an object (as OpenAI sends it)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolCallDelta:
    """A piece of the call at `index` (its position among this message's calls). The first
    piece of a call carries `id` and `name`; every piece may carry more `arguments` text.
    Concatenating a call's pieces' `arguments` gives its complete arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        function: dict[str, Any] = {}
        if self.name is not None:
            function["name"] = self.name
        if self.arguments or self.name is not None:
            function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass
class ParsedDelta:
    """What a piece of model text adds to a message: answer text, reasoning text, tool calls.
    Empty when the parser holds the text back (it may be the start of a call marker)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: "ParsedDelta") -> "ParsedDelta":
        """`self` followed by `other` (calls' pieces kept apart, in order)."""
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        return self


def assemble(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Whole calls from their pieces, in index order (what a client's accumulator does)."""
    calls: dict[int, tuple[list[str], list[str]]] = {}  # index -> ([id, name], arguments)
    for d in deltas:
        head, arguments = calls.setdefault(d.index, (["", ""], []))
        if d.id is not None:
            head[0] = d.id
        if d.name is not None:
            head[1] = d.name
        arguments.append(d.arguments)  # joined once: a long call comes in many pieces
    return [
        ToolCall(head[1], "".join(arguments), head[0])
        for _, (head, arguments) in sorted(calls.items())
    ]
