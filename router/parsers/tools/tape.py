"""The text a streaming tool parser reads (router/parsers/tools/stream.py), addressed by
absolute position: characters since the start of the output.

Appending a piece must not copy the text before it: a parser may hold a call's text until it
decides (a name, a pythonic value), and a model writes that text one token at a time, so
copying what is held on every piece would make the work quadratic in the call's length. The
text therefore lives in two parts: `window`, the text from `base` on, which the parser's
patterns run over; and before it, the pieces already read that may still be needed (`text`
joins them). `append` moves what the parser has read out of the window once there is enough
of it, so an append copies only the unread rest (a marker's prefix at most) and every
character moves out once.

Invariant: the parser's position is never before `base` (parsers never step back; they send
held text with `text(start, pos)`). `forget` drops the read pieces, where the parser holds
no earlier position."""

from __future__ import annotations

from bisect import bisect_right

_MOVE_AT = 4096  # read characters the window keeps before they move out


class Tape:
    __slots__ = ("window", "base", "_kept", "_starts")

    def __init__(self) -> None:
        self.window = ""
        self.base = 0
        self._kept: list[str] = []  # read text before `base`, in pieces, in order
        self._starts: list[int] = []  # each kept piece's position

    @property
    def end(self) -> int:
        """The position after the last character received."""
        return self.base + len(self.window)

    def append(self, text: str, read: int) -> None:
        """The next piece of the output; the parser has read up to `read`."""
        cut = read - self.base
        if cut >= _MOVE_AT:
            self._kept.append(self.window[:cut])
            self._starts.append(self.base)
            self.window, self.base = self.window[cut:] + text, read
        else:
            self.window += text

    def text(self, start: int, stop: int) -> str:
        """The text from `start` to `stop` (before the window only where not forgotten)."""
        base = self.base
        if start >= base:
            return self.window[start - base : stop - base]
        first = bisect_right(self._starts, start) - 1
        if first < 0:
            raise AssertionError(f"text at {start} was forgotten")
        parts = []
        for piece_start, piece in zip(self._starts[first:], self._kept[first:]):
            if piece_start >= stop:
                break
            parts.append(piece[max(0, start - piece_start) : stop - piece_start])
        if stop > base:
            parts.append(self.window[: stop - base])
        return "".join(parts)

    def forget(self) -> None:
        """Drops the read text before the window (no earlier position is needed)."""
        self._kept.clear()
        self._starts.clear()
