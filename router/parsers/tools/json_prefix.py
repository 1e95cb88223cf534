"""An incremental JSON validator: how much of a growing text is a valid prefix of one JSON
value, and where that value ends. The tool parsers stream a call's `arguments` only while
they are such a prefix, and learn from it where the arguments object ends.

Strict RFC 8259 syntax: strings with the nine escapes and `\\uXXXX` (no raw control
characters), numbers without leading zeros or bare dots, `true` / `false` / `null`, and
space, tab, CR, LF as whitespace. Whitespace before the value is part of it; whitespace
after it is not consumed. A top-level number is complete only once a character that cannot
continue it follows (inside a container the closing bracket does that)."""

from __future__ import annotations

import re

from router.parsers.markers import matched

_WS = re.compile(r"[ \t\n\r]*")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_DIGITS = re.compile(r"[0-9]+")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrt')
_LITERALS = {"t": "true", "f": "false", "n": "null"}

# What comes next. Nesting lives on the stack ("{" / "[" per open container).
_VALUE = 0  # a value (at the top, after ":" or after "," in an array)
_FIRST_ITEM = 1  # a value or "]" (just after "[")
_FIRST_KEY = 2  # a key or "}" (just after "{")
_KEY = 3  # a key (after "," in an object)
_COLON = 4
_AFTER = 5  # "," or the container's closing bracket
_STRING = 6  # inside a string
_ESCAPE = 7  # after a backslash
_UNICODE = 8  # inside \uXXXX
_NUMBER = 9
_LITERAL = 10  # inside true / false / null
_DONE = 11
_FAILED = 12

# A number's progress: after "-", after a leading "0", in the integer digits, after ".",
# in the fraction, after "e", after the exponent's sign, in the exponent. A number may end
# only in the integer, fraction or exponent digits (or after a lone "0").
_NUMBER_STEPS: dict[tuple[int, str], int] = {
    (0, "0"): 1,
    (0, "d"): 2,
    (1, "."): 3,
    (1, "e"): 5,
    (2, "d"): 2,
    (2, "0"): 2,
    (2, "."): 3,
    (2, "e"): 5,
    (3, "d"): 4,
    (3, "0"): 4,
    (4, "d"): 4,
    (4, "0"): 4,
    (4, "e"): 5,
    (5, "+"): 6,
    (5, "-"): 6,
    (5, "d"): 7,
    (5, "0"): 7,
    (6, "d"): 7,
    (6, "0"): 7,
    (7, "d"): 7,
    (7, "0"): 7,
}
_NUMBER_ENDS = frozenset((1, 2, 4, 7))
_NUMBER_CLASS = {
    **{c: "d" for c in "123456789"},
    "0": "0",
    ".": ".",
    "e": "e",
    "E": "e",
    "+": "+",
    "-": "-",
}


class JsonPrefix:
    """Feed it the text of one JSON value in pieces; it consumes each piece as far as the
    text stays a valid prefix, and says when the value is complete (`done`) or can no longer
    be (`failed`)."""

    __slots__ = ("_state", "_stack", "_key", "_left", "_literal", "_number")

    def __init__(self) -> None:
        self._state = _VALUE
        self._stack: list[str] = []
        self._key = False  # the open string is an object key
        self._left = 0  # hex digits (\uXXXX) or literal letters still expected
        self._literal = ""
        self._number = 0

    @property
    def done(self) -> bool:
        """The value is complete: nothing more is consumed."""
        return self._state == _DONE

    @property
    def failed(self) -> bool:
        """The text stopped being a valid prefix (at the index `feed` returned)."""
        return self._state == _FAILED

    def feed(self, text: str, start: int = 0, end: int | None = None) -> int:
        """Consumes `text[start:end]` as far as it continues the value; returns the index
        after the last character consumed (the value's end once `done`, the offending
        character's index once `failed`). Each character is looked at once: the state
        carries over to the next call."""
        i, n = start, len(text) if end is None else end
        while i < n:
            state = self._state
            if state == _STRING:
                m = _STRING_RUN.match(text, i, n)
                if m:
                    i = m.end()
                    continue
                c = text[i]
                if c == '"':
                    self._end_value(key=self._key)
                elif c == "\\":
                    self._state = _ESCAPE
                else:  # a raw control character
                    return self._fail(i)
            elif state == _ESCAPE:
                c = text[i]
                if c == "u":
                    self._state, self._left = _UNICODE, 4
                elif c in _ESCAPES:
                    self._state = _STRING
                else:
                    return self._fail(i)
            elif state == _UNICODE:
                if text[i] not in _HEX:
                    return self._fail(i)
                self._left -= 1
                if not self._left:
                    self._state = _STRING
            elif state == _NUMBER:
                step = _NUMBER_STEPS.get((self._number, _NUMBER_CLASS.get(text[i], "")))
                if step is None:  # the number ends here (without this character)
                    if self._number not in _NUMBER_ENDS:
                        return self._fail(i)
                    self._end_value()
                    continue
                self._number = step
                if step in (2, 4, 7):
                    m = _DIGITS.match(text, i + 1, n)
                    if m:
                        i = m.end()
                        continue
            elif state == _LITERAL:
                if text[i] != self._literal[-self._left]:
                    return self._fail(i)
                self._left -= 1
                if not self._left:
                    self._end_value()
            elif state >= _DONE:
                return i
            else:
                i = matched(_WS.match(text, i, n)).end()
                if i == n:
                    break
                if not self._structural(text[i]):
                    return self._fail(i)
            i += 1
        return i

    def _structural(self, c: str) -> bool:
        """One character outside strings, numbers and literals; False if it is not allowed."""
        state = self._state
        if state == _VALUE or state == _FIRST_ITEM:
            if c == "]" and state == _FIRST_ITEM:
                self._stack.pop()
                self._end_value()
            elif c == "{":
                self._stack.append("{")
                self._state = _FIRST_KEY
            elif c == "[":
                self._stack.append("[")
                self._state = _FIRST_ITEM
            elif c == '"':
                self._state, self._key = _STRING, False
            elif c == "-" or "0" <= c <= "9":
                self._state = _NUMBER
                self._number = {"-": 0, "0": 1}.get(c, 2)
            elif c in _LITERALS:
                self._state, self._literal = _LITERAL, _LITERALS[c]
                self._left = len(self._literal) - 1
            else:
                return False
        elif state == _FIRST_KEY or state == _KEY:
            if c == '"':
                self._state, self._key = _STRING, True
            elif c == "}" and state == _FIRST_KEY:
                self._stack.pop()
                self._end_value()
            else:
                return False
        elif state == _COLON:
            if c != ":":
                return False
            self._state = _VALUE
        else:  # _AFTER
            top = self._stack[-1]
            if c == ",":
                self._state = _KEY if top == "{" else _VALUE
            elif c == ("}" if top == "{" else "]"):
                self._stack.pop()
                self._end_value()
            else:
                return False
        return True

    def _end_value(self, key: bool = False) -> None:
        if key:
            self._state = _COLON
        else:
            self._state = _AFTER if self._stack else _DONE

    def _fail(self, i: int) -> int:
        self._state = _FAILED
        return i


def valid_prefix(text: str) -> tuple[int, bool]:
    """How many leading characters of `text` are a valid prefix of one JSON value, and
    whether that prefix is the complete value."""
    validator = JsonPrefix()
    end = validator.feed(text)
    return end, validator.done
