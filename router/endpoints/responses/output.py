"""A response's output items, built from the parsed pieces of its one completion
(`ParsedDelta`s: reasoning, answer text, tool-call pieces), and the streaming events that
announce them.

Items follow the order the text takes: a `reasoning` item, a `message` item (one
`output_text` part), a `function_call` item per call; whenever the kind of text changes, the
open item is finished and the next one opened (text after a call opens another message).
Each item goes through the same events (vLLM's and OpenAI's names):

    output_item.added, [content_part.added, <text>.delta..., <text>.done, content_part.done],
    output_item.done

with `<text>` = `output_text` for a message, `reasoning_text` for reasoning; a function call
has no content part: `function_call_arguments.delta`... and `.done`. The deltas of an item
concatenated are its final text (or arguments). A response whose model wrote nothing has one
empty message. Events carry no `sequence_number`: run.py numbers them as it sends them.

A call's pieces come before the next call's (router/parsers/tools/parser.py's contract): a piece for
a new index opens a new function_call item.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from router.parsers.tools.types import ParsedDelta, ToolCallDelta, new_call_id

Kind = Literal["reasoning", "message", "function_call"]
_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}
_TEXT_EVENT = {"reasoning": "response.reasoning_text", "message": "response.output_text"}


@dataclass(slots=True)
class _Item:
    kind: Kind
    index: int  # output_index
    id: str
    pieces: list[str] = field(default_factory=list)  # text, reasoning or arguments
    call_id: str = ""
    name: str = ""
    call_index: int = -1  # the ToolCallDelta index this item is
    status: str = "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": []}

    def to_json(self, done: bool = True) -> dict[str, Any]:
        """The item as output lists it (`done`: with its text; else as first announced)."""
        text = self.text if done else ""
        if self.kind == "function_call":
            return {
                "type": "function_call",
                "id": self.id,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": text,
                "status": self.status,
            }
        content = [self.part(text)] if done else []
        if self.kind == "reasoning":
            return {
                "type": "reasoning",
                "id": self.id,
                "summary": [],
                "content": content,
                "status": self.status,
            }
        return {
            "type": "message",
            "id": self.id,
            "role": "assistant",
            "status": self.status,
            "content": content,
        }


class OutputWriter:
    """`add` each ParsedDelta of the completion, then `close` once. `items` is the output;
    with `events`, every event is appended to `self.events` (the caller takes them)."""

    def __init__(self, events: bool = False) -> None:
        self.items: list[_Item] = []
        self.events: list[dict[str, Any]] = []
        self._keep_events = events
        self._open: _Item | None = None

    @property
    def in_reasoning(self) -> bool:
        return self._open is not None and self._open.kind == "reasoning"

    def add(self, parsed: ParsedDelta) -> None:
        if parsed.reasoning:
            self._text("reasoning", parsed.reasoning)
        if parsed.content:
            self._text("message", parsed.content)
        for piece in parsed.tool_calls:
            self._call(piece)

    def close(self, incomplete: bool = False) -> None:
        """The completion ended (`incomplete`: cut off by max_output_tokens, which marks the
        item open then incomplete)."""
        if not self.items:
            self._open_item("message")
        if self._open is not None:
            self._finish(self._open, "incomplete" if incomplete else "completed")
            self._open = None

    def output(self) -> list[dict[str, Any]]:
        return [item.to_json() for item in self.items]

    # ---- items ----------------------------------------------------------------------------
    def _text(self, kind: Kind, text: str) -> None:
        item = self._open if self._open is not None and self._open.kind == kind else None
        if item is None:
            item = self._open_item(kind)
        item.pieces.append(text)
        if self._keep_events:
            self._emit(
                f"{_TEXT_EVENT[kind]}.delta",
                item,
                content_index=0,
                delta=text,
                **({"logprobs": []} if kind == "message" else {}),
            )

    def _call(self, piece: ToolCallDelta) -> None:
        item = self._open
        if item is None or item.kind != "function_call" or item.call_index != piece.index:
            item = self._open_item("function_call", piece)
        if piece.arguments:
            item.pieces.append(piece.arguments)
            if self._keep_events:
                self._emit("response.function_call_arguments.delta", item, delta=piece.arguments)

    def _open_item(self, kind: Kind, call: ToolCallDelta | None = None) -> _Item:
        if self._open is not None:
            self._finish(self._open, "completed")
        item = _Item(kind, len(self.items), f"{_PREFIX[kind]}_{uuid.uuid4().hex}")
        if call is not None:
            item.call_id, item.name = call.id or new_call_id(), call.name or ""
            item.call_index = call.index
        self.items.append(item)
        self._open = item
        if self._keep_events:
            self._emit(
                "response.output_item.added",
                None,
                output_index=item.index,
                item=item.to_json(done=False),
            )
            if kind != "function_call":
                self._emit("response.content_part.added", item, content_index=0, part=item.part(""))
        return item

    def _finish(self, item: _Item, status: str) -> None:
        item.status = status
        if not self._keep_events:
            return
        text = item.text
        if item.kind == "function_call":
            self._emit(
                "response.function_call_arguments.done", item, name=item.name, arguments=text
            )
        else:
            self._emit(
                f"{_TEXT_EVENT[item.kind]}.done",
                item,
                content_index=0,
                text=text,
                **({"logprobs": []} if item.kind == "message" else {}),
            )
            self._emit("response.content_part.done", item, content_index=0, part=item.part(text))
        self._emit("response.output_item.done", None, output_index=item.index, item=item.to_json())

    def _emit(self, type: str, of: _Item | None, **fields: Any) -> None:
        """An event (`of`: the item whose id and index it names by `item_id`)."""
        where = {} if of is None else {"item_id": of.id, "output_index": of.index}
        self.events.append({"type": type, **where, **fields})
