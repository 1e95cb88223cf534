"""Finding markers (`<tool_call>`, `</think>`, ...) in text that arrives in pieces."""

from __future__ import annotations

import re


def held_prefix(text: str, start: int, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text[start:]` may be the beginning of one of
    `markers` (a parser holds them back until the next piece tells)."""
    held = 0
    for marker in markers:
        i = text.find(marker[0], max(start, len(text) - len(marker) + 1))
        while i != -1:  # the first match is the longest
            if marker.startswith(text[i:]):
                held = max(held, len(text) - i)
                break
            i = text.find(marker[0], i + 1)
    return held


def matched(m: re.Match[str] | None) -> re.Match[str]:
    """`m`, where it cannot be None (a pattern that matches the empty string, or a marker
    found at that place before): the parsers' typed `pattern.match(...).end()`."""
    if m is None:
        raise AssertionError("a pattern that always matches here did not")
    return m
