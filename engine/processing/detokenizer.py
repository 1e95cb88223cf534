"""Incremental detokenization with stop strings, per completion (vLLM's rules).

Text grows token by token through `tokenizers`' own `DecodeStream` (it keeps the window of
recent tokens, so multi-byte characters split across tokens come out whole; per token as fast
as re-decoding that window here, or up to 1.4x faster, with the same text:
docs/benchmarks/engine.md). Stop strings are looked for only once more than `min_tokens` tokens are
out, and must end in text that came after the min_tokens-th token (they may begin before it). The
text is cut before the stop string, or right after it with `include_stop_str_in_output`. Streamed
deltas hold back the last `len(longest stop string) - 1` characters until they can no longer begin a
stop string that would be cut out (nothing is held back when stop strings stay in the text: a match
always ends in new text, so nothing already sent is ever cut)."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from engine.processing.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool,
        stop: tuple[str, ...],
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop_str = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.holdback = (
            max(len(s) for s in stop) - 1 if stop and not include_stop_str_in_output else 0
        )
        self.ids: list[int] = []
        self.text = ""
        self._num_tokens = 0  # output tokens seen, a left-out stop token included
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._sent = 0

    def append(self, token_id: int, stop_terminated: bool = False) -> str | None:
        """Add one output token; returns the stop string the text now ends at, if any.
        `stop_terminated`: the token ended the request (EOS or a stop token id); its text is
        left out unless include_stop_str_in_output."""
        self._num_tokens += 1
        checked_from = len(self.text)
        if self.include_stop_str or not stop_terminated:
            self._decode(token_id)
        if not self.stop or self._num_tokens <= self.min_tokens:
            return None
        return self._cut_at_stop(checked_from)

    def resume(self, output_token_ids: tuple[int, ...], num_text_chars: int) -> None:
        """Continue after outputs produced elsewhere, of whose text the caller already has
        `num_text_chars` characters: the text (and any held-back or incomplete character at
        the seam) is rebuilt token by token exactly as it was, and streaming continues right
        after what was sent. None of them ended the request, so no stop string is cut."""
        for token_id in output_token_ids:
            self._num_tokens += 1
            self._decode(token_id)
        if num_text_chars > len(self.text):
            raise ValueError(
                f"resume_text_chars: {num_text_chars} characters sent, but the "
                f"outputs decode to {len(self.text)}"
            )
        self._sent = num_text_chars

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out that can no longer turn into (part of) a stop string."""
        end = len(self.text) if finished else max(self._sent, len(self.text) - self.holdback)
        delta, self._sent = self.text[self._sent : end], end
        return delta

    def _decode(self, token_id: int) -> None:
        self.ids.append(token_id)
        piece = self.tokenizer.stream_step(self._stream, token_id)
        if piece is not None:  # None: an incomplete character, completed by a later token
            self.text += piece

    def _cut_at_stop(self, new_from: int) -> str | None:
        """The first stop string (in `stop` order) ending after `new_from`; cuts the text."""
        if len(self.text) == new_from:
            return None
        for s in self.stop:
            at = self.text.find(s, max(0, new_from - len(s) + 1))
            if at >= 0:
                self.text = self.text[: at + len(s) if self.include_stop_str else at]
                return s
        return None
