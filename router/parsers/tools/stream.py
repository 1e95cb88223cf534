"""What the built-in tool parsers share: each format is written as a generator, `block()`,
that reads the text as if it were all there (`yield from self.literal(...)`, ...) and
pauses inside the helpers below wherever the decision needs text that has not come yet. So a
decision never depends on where the pieces were cut, which is the contract's "any pieces
give the same result" (router/parsers/tools/base.py).

Life of the text here: `feed` appends to the tape (router/parsers/tools/tape.py: the text by
absolute position, appended without copying what came before) and resumes `parse()`; every
reader goes on from where it stopped, so the work is linear in the text. Outside calls,
`text_until` sends content at once and holds back only a possible marker prefix. At a
marker, the format's `block(mark)` reads the call(s); until a call is announced its text is
held, and if it turns out to be no call, `release(mark)` sends it as content and the parse
goes on from where that showed. After a complete block, the whitespace (and the format's
`SEPARATOR`) before the next marker or the end of the output goes nowhere.

One call's text, from the position where its held text begins to its end, is at most
`MAX_CALL_CHARS` characters (docs/router.md, "Tool calling"). A block's readers see the text
only up to that limit and read it as the end of the output: the call ends as far as it was
valid (`broken` where it was announced; held text goes out as content), then `capped` is
set, tool call parsing stops and the rest of the output is content. The limit is a position
in the text, so where the pieces were cut does not matter here either.

Invariants: positions are absolute and never move back (held text is sent with `release`,
never re-read); `_trim` forgets read text and runs only inside `text_until`, `stream_args`
and readers that the format calls where no earlier position is held."""

from __future__ import annotations

import json
import re
import sys
from abc import abstractmethod
from typing import ClassVar, Generator, TypeVar

from router.parsers.markers import held_prefix, matched
from router.parsers.tools.base import ToolParser
from router.parsers.tools.json_prefix import JsonPrefix
from router.parsers.tools.tape import Tape
from router.parsers.tools.types import (
    FunctionTool,
    ParsedDelta,
    ToolCallDelta,
    new_call_id,
)

T = TypeVar("T")
Gen = Generator[None, None, T]

WS = re.compile(r"[ \t\n\r]*")
_NO_LIMIT = sys.maxsize


class StreamingToolParser(ToolParser):
    MARKERS: ClassVar[tuple[str, ...]]
    """The texts that may begin a call block (longest first where one prefixes another)."""
    SEPARATOR: ClassVar[str] = ""
    """Text allowed between two blocks besides whitespace (Llama's `;`)."""
    MAX_CALL_CHARS: ClassVar[int] = 1 << 20
    """The most characters one call's text may have (its marker or held text included); a
    call that runs past it ends tool call parsing: the rest of the output is content."""
    _starts: ClassVar[re.Pattern]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "MARKERS" in cls.__dict__:
            cls._starts = re.compile("|".join(map(re.escape, cls.MARKERS)))

    def __init__(self, tools: list[FunctionTool]) -> None:
        super().__init__(tools)
        self.tape = Tape()
        self.pos = 0  # where reading goes on (absolute; never before tape.base)
        self.final = False  # finish() was called: no more text
        self.capped = False  # a call ran past MAX_CALL_CHARS: the rest is content
        self._limit = _NO_LIMIT  # the position a block's readers see up to
        self._delta = ParsedDelta()
        self._calls = 0
        self._parse: Gen[None] | None = self.parse()

    @abstractmethod
    def block(self, mark: int) -> Gen[bool | None]:
        """The call block whose marker is at `pos` (`mark`: where its held text begins, at or
        before the marker). True: it ended cleanly; None: it was no call (released); False:
        it ended otherwise, e.g. a call broke (the parse goes on from there as text)."""

    def parse(self, mark: int | None = None) -> Gen[None]:
        """Text and blocks to the end (`mark`: a block's marker is at `pos`), or until a call
        runs past the limit."""
        while not self.capped:
            if mark is None:
                self._limit = _NO_LIMIT
                mark = yield from self.text_until()
                if mark is None:
                    return
            self.bound(mark)
            ended = yield from self.block(mark)
            mark = (yield from self.gap()) if ended and not self.capped else None

    def bound(self, start: int) -> None:
        """A call's text begins at `start`: its readers see at most MAX_CALL_CHARS from there."""
        self._limit = start + self.MAX_CALL_CHARS

    def feed(self, text: str) -> ParsedDelta:
        self.tape.append(text, self.pos)
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
        if self._parse is None:  # after the end of the output, or past the limit
            self.content(self.tape.end)
        return delta

    # -- the text ----------------------------------------------------------------------------

    def stop(self) -> int:
        """Where the text readers may see ends (the text received, or the call's limit)."""
        return min(self.tape.end, self._limit)

    def text(self, start: int, stop: int) -> str:
        return self.tape.text(start, stop)

    def ahead(self, count: int) -> str:
        """Up to `count` characters at `pos` (those seen so far)."""
        base = self.tape.base
        return self.tape.window[self.pos - base : min(self.pos + count, self.stop()) - base]

    def scan(self, chars: re.Pattern) -> int:
        """Where the longest match of `chars` at `pos` ends, in the text seen so far (nothing
        consumed, nothing awaited)."""
        base = self.tape.base
        m = chars.match(self.tape.window, self.pos - base, self.stop() - base)
        return base + matched(m).end()

    # -- output ------------------------------------------------------------------------------

    def content(self, end: int) -> None:
        """Sends the text from `pos` to `end` as content; `pos` moves to `end`."""
        self._delta.content += self.text(self.pos, end)
        self.pos = end

    def release(self, mark: int) -> None:
        """Sends the held text from `mark` to `pos` as content (it was no call)."""
        self._delta.content += self.text(mark, self.pos)

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
        """Waits for the next piece (a reader needs text past `stop()`); False at the end of
        the output, or at the call's limit (`capped`), which its readers take for the end."""
        if self.final:
            return False
        if self.tape.end >= self._limit:
            self.capped = True
            return False
        yield
        return True

    def text_until(self) -> Gen[int | None]:
        """Content up to the next marker: its position (`pos` there), or None at the end."""
        while True:
            self._trim()
            base, window = self.tape.base, self.tape.window
            m = self._starts.search(window, self.pos - base)
            if m:
                self.content(base + m.start())
                return self.pos
            held = 0 if self.final else held_prefix(window, self.pos - base, self.MARKERS)
            self.content(self.tape.end - held)
            if not (yield from self.more()):
                return None

    def at_marker(self) -> Gen[bool]:
        """A marker begins at `pos` (nothing consumed)."""
        longest = max(map(len, self.MARKERS))
        while True:
            rest = self.ahead(longest)
            if self._starts.match(rest):
                return True
            if not any(m.startswith(rest) for m in self.MARKERS) or not (yield from self.more()):
                return False

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
        if not (self.final and self.pos >= self.tape.end):  # text follows (or the limit)
            self.release(start)
        return None

    def run(self, chars: re.Pattern) -> Gen[str]:
        """The longest run at `pos` that `chars` matches (consumed). `chars` matches any
        piece of a run (a run is read on from where the last piece ended)."""
        start = self.pos
        while True:
            self.pos = self.scan(chars)
            if self.pos < self.stop() or not (yield from self.more()):
                return self.text(start, self.pos)

    def peek(self) -> Gen[str]:
        """The character at `pos` (not consumed); "" at the end of the output."""
        while self.pos >= self.stop():
            if not (yield from self.more()):
                return ""
        return self.tape.window[self.pos - self.tape.base]

    def literal(self, *options: str) -> Gen[str | None]:
        """Whichever of `options` comes next (consumed), or None (nothing consumed)."""
        while True:
            rest = self.ahead(max(map(len, options)))
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
            self.pos = self._validate(validator)
            if validator.done:
                return self.text(start, self.pos)
            if validator.failed or not (yield from self.more()):
                return None

    def stream_args(self, index: int) -> Gen[bool]:
        """The JSON object at `pos`, streamed as call `index`'s arguments while it stays a
        valid prefix: True once complete; False (`broken`) where it stops being valid or the
        output ends."""
        validator = JsonPrefix()
        while True:
            start = self.pos
            self.pos = self._validate(validator)
            if self.pos > start:
                self.arguments(index, self.text(start, self.pos))
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
            self.bound(mark)
        return done

    def _validate(self, validator: JsonPrefix) -> int:
        """Feeds the text seen from `pos` to `validator`: where it stopped (absolute)."""
        base = self.tape.base
        return base + validator.feed(self.tape.window, self.pos - base, self.stop() - base)

    def _trim(self) -> None:
        self.tape.forget()
