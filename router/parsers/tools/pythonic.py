"""Pythonic tool calls (Llama 3.2 / Llama 4, vLLM's `pythonic`): a Python list of calls with
keyword arguments whose values are Python literals:

    [get_weather(city="Paris", days=3), get_time(tz='UTC')]

A call is announced at the `(` after a tool's name; each argument goes out (as JSON) once
its value is complete, read with `ast.literal_eval`; the arguments object closes at the `)`.
A positional argument or a value that is no literal (or has no JSON form) breaks the call."""

from __future__ import annotations

import ast
import json
import re

from router.parsers.markers import matched
from router.parsers.tools.base import register_tool_parser
from router.parsers.tools.stream import WS, Gen, StreamingToolParser

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*|")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|")
# Inside a value: a run of ordinary characters, or a complete string literal (any prefix
# letters are part of the ordinary run before it).
_PLAIN = re.compile(r"""[^'"()\[\]{},]*""")
_STRING = re.compile(
    r"""'''(?:[^\\]|\\.)*?'''|\"\"\"(?:[^\\]|\\.)*?\"\"\""""
    r"""|'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*\"""",
    re.DOTALL,
)
_OPEN, _CLOSE = "([{", ")]}"


@register_tool_parser("pythonic")
class PythonicToolParser(StreamingToolParser):
    MARKERS = ("[",)

    def block(self, mark: int) -> Gen[bool | None]:
        self.pos += 1
        while True:
            yield from self.run(WS)
            name = yield from self.run(_NAME)
            if name not in self.tools or not (yield from self.expect("(")):
                self.release(mark)
                return None
            if not (yield from self._arguments(self.announce(name))):
                self.broken = True
                return False
            if not (yield from self.expect(",")):
                return (yield from self.expect("]"))
            mark = self.pos

    def _arguments(self, index: int) -> Gen[bool]:
        """`key=value, ...)` at `pos`, streamed as a JSON object; False where it breaks."""
        before = "{"
        while not (yield from self.expect(")")):
            yield from self.run(WS)
            key = yield from self.run(_KEY)
            if not key or not (yield from self.expect("=")):
                return False
            start = self.pos
            value = yield from self._value()
            try:
                value = json.dumps(
                    ast.literal_eval(value.strip()), ensure_ascii=False, allow_nan=False
                )
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                if value:  # no literal: it goes out as content (else: the output ended)
                    self.pos = start
                return False
            self.arguments(index, f"{before}{json.dumps(key)}: {value}")
            before = ", "
            if not (yield from self.expect(",")) and (yield from self.peek()) != ")":
                return False
        self.arguments(index, "{}" if before == "{" else "}")
        return True

    def _value(self) -> Gen[str]:
        """The text of the expression at `pos` up to a `,` or `)` outside brackets and
        strings (not consumed); "" where it cannot be one."""
        start, depth = self.pos, 0
        while True:
            self.pos = matched(_PLAIN.match(self.buf, self.pos)).end()
            c = yield from self.peek()
            if not c:  # the end of the output
                return ""
            if c in "'\"":
                end = self._string_end()
                if end is None:
                    if not (yield from self.more()):
                        return ""
                    continue
                self.pos = end
                continue
            if depth == 0 and c in ",)":
                return self.buf[start : self.pos]
            if c in _OPEN:
                depth += 1
            elif c in _CLOSE:
                if depth == 0:
                    return ""
                depth -= 1
            self.pos += 1

    def _string_end(self) -> int | None:
        """Where the string literal at `pos` ends; None while it may still be incomplete."""
        m = _STRING.match(self.buf, self.pos)
        if m is None:
            return None
        if not self.final and m.end() == len(self.buf) and len(m.group()) == 2:
            return None  # '' or "" at the end: maybe the start of a triple-quoted string
        return m.end()
