"""Incremental detokenization with stop strings, per completion.

Text grows token by token (a window of recent tokens is re-decoded so multi-byte characters
split across tokens come out whole). Streamed deltas hold back the last
`len(longest stop string) - 1` characters until they can no longer begin a stop string."""
from __future__ import annotations

from engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._sent = 0

    def append(self, token_id: int) -> bool:
        """Add one token; True if the text now contains a stop string (text is cut before it)."""
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, self.skip_special_tokens)  # noqa: E731
        prefix_text = decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = decode(self.ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False  # an incomplete character: wait for the next token
        checked_from = max(0, len(self.text) - self.holdback)
        self.text += new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        for s in self.stop:
            at = self.text.find(s, checked_from)
            if at >= 0:
                self.text = self.text[:at]
                return True
        return False

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out that can no longer turn into (part of) a stop string."""
        end = len(self.text) if finished else max(self._sent, len(self.text) - self.holdback)
        delta, self._sent = self.text[self._sent : end], end
        return delta
