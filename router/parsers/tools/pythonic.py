"""Pythonic tool calls (Llama 3.2 / Llama 4, vLLM's `pythonic`): a Python list of calls with
keyword arguments whose values are Python literals:

    [get_weather(city="Paris", days=3), get_time(tz='UTC')]

A call is announced at the `(` after a tool's name; each argument goes out (as JSON) once
its value is complete, read with `ast.literal_eval`; the arguments object closes at the `)`.
A positional argument or a value that is no literal (or has no JSON form) breaks the call:
the value's text goes out as content and the parse goes on after it. A value the output cuts
off goes nowhere (the call is finished as far as it was valid).

Every character is read once: a value is scanned as it arrives, a string literal from where
the last piece ended (a one-line string that reaches a line end is no literal), and a
value's text is evaluated once, when it is complete."""

from __future__ import annotations

import ast
import json
import re

from router.parsers.tools.base import register_tool_parser
from router.parsers.tools.stream import WS, Gen, StreamingToolParser

_NAME_CHARS = re.compile(r"[A-Za-z0-9_.]*")  # after a first letter or "_"
_KEY_CHARS = re.compile(r"[A-Za-z0-9_]*")
# Inside a value, outside strings: a run of ordinary characters.
_PLAIN = re.compile(r"""[^'"()\[\]{},]*""")
# Inside a string literal: a run that cannot end it (a one-line string ends at a line end).
_SHORT_BODY = {q: re.compile(rf"[^{q}\\\n]*") for q in "'\""}
_LONG_BODY = {q: re.compile(rf"[^{q}\\]*") for q in "'\""}
_OPEN, _CLOSE = "([{", ")]}"


@register_tool_parser("pythonic")
class PythonicToolParser(StreamingToolParser):
    MARKERS = ("[",)

    def block(self, mark: int) -> Gen[bool | None]:
        self.pos += 1
        while True:
            yield from self.run(WS)
            name = yield from self._identifier(_NAME_CHARS)
            if name not in self.tools or not (yield from self.expect("(")):
                self.release(mark)
                return None
            if not (yield from self._arguments(self.announce(name))):
                self.broken = True
                return False
            if not (yield from self.expect(",")):
                return (yield from self.expect("]"))
            mark = self.pos
            self.bound(mark)

    def _arguments(self, index: int) -> Gen[bool]:
        """`key=value, ...)` at `pos`, streamed as a JSON object; False where it breaks."""
        before = "{"
        while not (yield from self.expect(")")):
            self._trim()  # the call was announced: no earlier position is held
            held = self.pos  # this argument's text, until it goes out as JSON
            yield from self.run(WS)
            key = yield from self._identifier(_KEY_CHARS)
            if not key or not (yield from self.expect("=")):
                return self._cut_off(held)
            start = self.pos
            value = yield from self._value()
            if not value:  # the output ended, or a closing bracket that opened nothing
                return self._cut_off(held)
            try:
                value = json.dumps(
                    ast.literal_eval(value.strip()), ensure_ascii=False, allow_nan=False
                )
            except Exception:  # noqa: BLE001 - any text: literal_eval raises ValueError,
                # SyntaxError, TypeError, MemoryError, RecursionError, SystemError (deep
                # nesting), json.dumps ValueError / TypeError / RecursionError
                self.release(start)  # no literal: its text is content
                return False
            self.arguments(index, f"{before}{json.dumps(key)}: {value}")
            before = ", "
            if not (yield from self.expect(",")) and (yield from self.peek()) != ")":
                return self._cut_off(held)
        self.arguments(index, "{}" if before == "{" else "}")
        return True

    def _cut_off(self, held: int) -> bool:
        """The argument held from `held` broke off: at the call's limit its text is content
        (at the end of the output it goes nowhere)."""
        if self.capped:
            self.release(held)
        return False

    def _identifier(self, chars: re.Pattern) -> Gen[str]:
        """A name at `pos`: a letter or "_", then `chars` (consumed); "" where none begins
        (nothing consumed)."""
        c = yield from self.peek()
        if not (c.isascii() and (c.isalpha() or c == "_")):
            return ""
        return (yield from self.run(chars))

    def _value(self) -> Gen[str]:
        """The text of the expression at `pos` up to a `,` or `)` outside brackets and
        strings (consumed up to it); "" where it cannot be one (the output ends first, or a
        closing bracket opened nothing: `pos` there). A one-line string that reaches a line
        end gives the text up to it (no literal)."""
        start, depth = self.pos, 0
        while True:
            self.pos = self.scan(_PLAIN)
            c = yield from self.peek()
            if not c:  # the end of the output
                return ""
            if c in "'\"":
                ended = yield from self._string(c)
                if ended is None:
                    return self.text(start, self.pos)
                if not ended:
                    return ""
                continue
            if depth == 0 and c in ",)":
                return self.text(start, self.pos)
            if c in _OPEN:
                depth += 1
            elif c in _CLOSE:
                if depth == 0:
                    return ""
                depth -= 1
            self.pos += 1

    def _string(self, quote: str) -> Gen[bool | None]:
        """The string literal at `pos` (opened by `quote`, three of them for a long one),
        consumed: True once it ends; False where the output ends first; None at a line end
        inside a one-line string (`pos` there: it can never end)."""
        triple = quote * 3
        long = yield from self._triple(triple)
        self.pos += 3 if long else 1
        body = (_LONG_BODY if long else _SHORT_BODY)[quote]
        while True:
            self.pos = self.scan(body)
            c = yield from self.peek()
            if not c:
                return False
            if c == "\\":  # an escape: the next character, whatever it is
                self.pos += 1
                if not (yield from self.peek()):
                    return False
                self.pos += 1
            elif c != quote:  # (a line end stops a one-line string's run; other
                if c == "\n" and not long:  # characters came after a wait: read on)
                    return None
            elif not long or (yield from self._triple(triple)):
                self.pos += len(triple) if long else 1
                return True
            else:  # a quote in a long string, not three
                self.pos += 1

    def _triple(self, triple: str) -> Gen[bool]:
        """`triple` at `pos` (nothing consumed): waits until the text decides."""
        while len(seen := self.ahead(3)) < 3 and triple.startswith(seen):
            if not (yield from self.more()):
                return False
        return seen == triple
