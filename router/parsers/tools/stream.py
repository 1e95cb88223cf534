"""What the built-in tool parsers share: each format is written as a generator, `block()`,
that reads the text as if it were all there (`yield from self.literal(...)`, ...) and
pauses inside the helpers below wherever the decision needs text that has not come yet. So a
decision never depends on where the pieces were cut, which is the contract's "any pieces
give the same result" (router/parsers/tools/base.py).

Life of the text here: `feed` appends to `buf` and resumes `parse()`. Outside calls,
`text_until` sends content at once and holds back only a possible marker prefix. At a
marker, the format's `block(mark)` reads the call(s); until a call is announced its text is
held, and if it turns out to be no call, `release(mark)` sends it as content and the parse
goes on from where that showed. After a complete block, the whitespace (and the format's
`SEPARATOR`) before the next marker or the end of the output goes nowhere.

Invariant: positions index `buf`. `_trim` drops consumed text and runs only inside
`text_until` and `stream_args`, which are entered holding no earlier position."""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from typing import ClassVar, Generator, TypeVar

from router.parsers.markers import held_prefix, matched
from router.parsers.tools.base import ToolParser
from router.parsers.tools.json_prefix import JsonPrefix
from router.parsers.tools.types import (
    FunctionTool,
    ParsedDelta,
    ToolCallDelta,
    new_call_id,
)

T = TypeVar("T")
Gen = Generator[None, None, T]

WS = re.compile(r"[ \t\n\r]*")
_TRIM_AT = 4096  # consumed characters kept before the buffer is cut


class StreamingToolParser(ToolParser):
    MARKERS: ClassVar[tuple[str, ...]]
    """The texts that may begin a call block (longest first where one prefixes another)."""
    SEPARATOR: ClassVar[str] = ""
    """Text allowed between two blocks besides whitespace (Llama's `;`)."""
    _starts: ClassVar[re.Pattern]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "MARKERS" in cls.__dict__:
            cls._starts = re.compile("|".join(map(re.escape, cls.MARKERS)))

    def __init__(self, tools: list[FunctionTool]) -> None:
        super().__init__(tools)
        self.buf = ""
        self.pos = 0
        self.final = False  # finish() was called: no more text
        self._delta = ParsedDelta()
        self._calls = 0
        self._parse: Gen[None] | None = self.parse()

    @abstractmethod
    def block(self, mark: int) -> Gen[bool | None]:
        """The call block whose marker is at `pos` (`mark`: where its held text begins, at or
        before the marker). True: it ended cleanly; None: it was no call (released); False:
        it ended otherwise, e.g. a call broke (the parse goes on from there as text)."""

    def parse(self, mark: int | None = None) -> Gen[None]:
        """Text and blocks to the end (`mark`: a block's marker is at `pos`)."""
        while True:
            if mark is None:
                mark = yield from self.text_until()
                if mark is None:
                    return
            mark = (yield from self.gap()) if (yield from self.block(mark)) else None

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        return self._resume()

    def finish(self) -> ParsedDelta:
        self.final = True
        delta = self._resume()
        assert self._parse is None, "a parser paused after the end of the output"
        return delta

    def _resume(self) -> ParsedDelta:
        delta = self._delta = ParsedDelta()
        if self._parse is not None:
            try:
                next(self._parse)
            except StopIteration:
                self._parse = None
        if self._parse is None:  # only after the end of the output
            self.content(len(self.buf))
        return delta

    # -- output ------------------------------------------------------------------------------

    def content(self, end: int) -> None:
        """Sends `buf[pos:end]` as content; `pos` moves to `end`."""
        self._delta.content += self.buf[self.pos : end]
        self.pos = end

    def release(self, mark: int) -> None:
        """Sends the held `buf[mark:pos]` as content (it was no call)."""
        self._delta.content += self.buf[mark : self.pos]

    def announce(self, name: str) -> int:
        """A new call to `name` (a tool's): its index."""
        index, self._calls = self._calls, self._calls + 1
        self._delta.tool_calls.append(ToolCallDelta(index, new_call_id(), name))
        return index

    def arguments(self, index: int, text: str) -> None:
        """More of call `index`'s arguments (joined to this delta's last piece of it)."""
        calls = self._delta.tool_calls
        if calls and calls[-1].index == index:
            calls[-1].arguments += text
        else:
            calls.append(ToolCallDelta(index, arguments=text))

    # -- reading: each waits until the text decides, and at the end of the output gives up --

    def more(self) -> Gen[bool]:
        """Waits for the next piece; False at the end of the output."""
        if self.final:
            return False
        yield
        return True

    def text_until(self) -> Gen[int | None]:
        """Content up to the next marker: its position (`pos` there), or None at the end."""
        while True:
            self._trim()
            m = self._starts.search(self.buf, self.pos)
            if m:
                self.content(m.start())
                return m.start()
            held = 0 if self.final else held_prefix(self.buf, self.pos, self.MARKERS)
            self.content(len(self.buf) - held)
            if not (yield from self.more()):
                return None

    def at_marker(self) -> Gen[bool]:
        """A marker begins at `pos` (nothing consumed)."""
        while not self._starts.match(self.buf, self.pos):
            rest = self.buf[self.pos :]
            if not any(m.startswith(rest) for m in self.MARKERS) or not (yield from self.more()):
                return False
        return True

    def gap(self) -> Gen[int | None]:
        """After a complete block: whitespace (and SEPARATOR) followed by a marker is the next
        block's held text (its start returned); followed by other text it is content (None);
        at the end of the output it goes nowhere (None)."""
        start = self.pos
        yield from self.run(WS)
        if self.SEPARATOR and (yield from self.literal(self.SEPARATOR)):
            yield from self.run(WS)
        if (yield from self.at_marker()):
            return start
        if self.pos < len(self.buf):
            self.release(start)
        return None

    def run(self, chars: re.Pattern) -> Gen[str]:
        """The longest run at `pos` that `chars` matches (consumed)."""
        start = self.pos
        while True:
            self.pos = matched(chars.match(self.buf, self.pos)).end()
            if self.pos < len(self.buf) or not (yield from self.more()):
                return self.buf[start : self.pos]

    def peek(self) -> Gen[str]:
        """The character at `pos` (not consumed); "" at the end of the output."""
        while self.pos >= len(self.buf):
            if not (yield from self.more()):
                return ""
        return self.buf[self.pos]

    def literal(self, *options: str) -> Gen[str | None]:
        """Whichever of `options` comes next (consumed), or None (nothing consumed)."""
        while True:
            rest = self.buf[self.pos : self.pos + max(map(len, options))]
            for option in options:
                if rest.startswith(option):
                    self.pos += len(option)
                    return option
            if not any(o.startswith(rest) for o in options) or not (yield from self.more()):
                return None

    def expect(self, *literals: str | tuple[str, ...]) -> Gen[bool]:
        """Each of `literals` in turn (a tuple: one of its options), whitespace allowed
        before each (consumed)."""
        for options in literals:
            yield from self.run(WS)
            if isinstance(options, str):
                options = (options,)
            if not (yield from self.literal(*options)):
                return False
        return True

    def peek_after_ws(self) -> Gen[str]:
        """The first character after whitespace (the whitespace consumed); "" at the end."""
        yield from self.run(WS)
        return (yield from self.peek())

    def json_value(self) -> Gen[str | None]:
        """One complete JSON value's text (consumed); None where it stops being one."""
        start, validator = self.pos, JsonPrefix()
        while True:
            self.pos = validator.feed(self.buf, self.pos)
            if validator.done:
                return self.buf[start : self.pos]
            if validator.failed or not (yield from self.more()):
                return None

    def stream_args(self, index: int) -> Gen[bool]:
        """The JSON object at `pos`, streamed as call `index`'s arguments while it stays a
        valid prefix: True once complete; False (`broken`) where it stops being valid or the
        output ends."""
        validator = JsonPrefix()
        while True:
            start = self.pos
            self.pos = validator.feed(self.buf, start)
            if self.pos > start:
                self.arguments(index, self.buf[start : self.pos])
            if validator.done:
                return True
            if validator.failed or not (yield from self.more()):
                self.broken = True
                return False
            self._trim()

    # -- the JSON call shapes ----------------------------------------------------------------

    def json_call(self, mark: int) -> Gen[bool | None]:
        """`{"name": "<tool>", "arguments": {...}}` at `pos` ("parameters" too; `{"name":
        "<tool>"}` is a call without arguments). Announced once its arguments begin."""
        name = None
        if (yield from self.expect("{", '"name"', ":")) and (
            yield from self.peek_after_ws()
        ) == '"':
            text = yield from self.json_value()
            name = json.loads(text) if text else None
        if name not in self.tools:
            self.release(mark)
            return None
        if (yield from self.expect("}")):
            self.arguments(self.announce(name), "{}")
            return True
        if not (
            (yield from self.expect(",", ('"arguments"', '"parameters"'), ":"))
            and (yield from self.peek_after_ws()) == "{"
        ):
            self.release(mark)
            return None
        if not (yield from self.stream_args(self.announce(name))):
            return False
        if not (yield from self.expect("}")):
            self.broken = True
            return False
        return True

    def call_list(self, mark: int) -> Gen[bool | None]:
        """`[call, call, ...]` of `json_call`s at `pos`. A call that is no call ends the list
        (it and the rest are content)."""
        if not (yield from self.expect("[")):
            self.release(mark)
            return None
        while done := (yield from self.json_call(mark)):
            if not (yield from self.expect(",")):
                return (yield from self.expect("]"))
            mark = self.pos
        return done

    def _trim(self) -> None:
        if self.pos > _TRIM_AT:
            self.buf, self.pos = self.buf[self.pos :], 0
