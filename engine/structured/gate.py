"""The reasoning gate: a reasoning model thinks between markers (`<think>` ... `</think>`)
before it answers, and a structured-output constraint binds the answer only (vLLM's
reasoning parser `is_reasoning_end`).

The rule, for a request whose StructuredOutputsParams carry `reasoning_start` and
`reasoning_end` (token-id sequences):
- At the start, the prompt is scanned: if the last marker in it is the end marker (a chat
  template that rendered the thinking closed, e.g. Qwen3's empty `<think>\\n\\n</think>`), the
  grammar is active from the first output token. Otherwise (the start marker is last, or no
  marker is in the prompt) the gate is closed.
- While it is closed, nothing is masked and the matcher sees no token (so a complete grammar
  cannot stop the request). It opens right after the output completes the end marker; the
  matcher then starts from its initial state on the token after it. Once open it stays open.

The gate is a function of prompt + output tokens alone, so wherever a sequence's matcher is
rebuilt or copied (a fork, a resumed request, the decode worker after remote prefill) the
gate follows from the same tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class ReasoningGate:
    """A closed gate (an open one is None): immutable, so a copy is a fork and a saved one a
    rollback."""

    end: tuple[int, ...]
    tail: tuple[int, ...] = ()
    """The output's last tokens that are a proper prefix of `end` (the marker in progress)."""

    @staticmethod
    def for_prompt(
        start: tuple[int, ...] | None, end: tuple[int, ...] | None, prompt: Sequence[int]
    ) -> ReasoningGate | None:
        """The gate at the first output token: None (open) without markers or when the
        prompt's last marker is `end`; closed when it is `start` or neither is there."""
        if start is None or end is None:
            return None
        for stop in range(len(prompt), 0, -1):  # the marker that ends last; `end` wins a tie
            if _ends_with(prompt, stop, end):
                return None
            if _ends_with(prompt, stop, start):
                break
        return ReasoningGate(end)

    def after(self, token_id: int) -> ReasoningGate | None:
        """The gate after one more output token: None once it completes the end marker."""
        seen = self.tail + (token_id,)
        if seen[-len(self.end) :] == self.end:
            return None
        for keep in range(min(len(seen), len(self.end) - 1), 0, -1):
            if seen[-keep:] == self.end[:keep]:
                return ReasoningGate(self.end, seen[-keep:])
        return ReasoningGate(self.end) if self.tail else self


def _ends_with(tokens: Sequence[int], stop: int, marker: tuple[int, ...]) -> bool:
    return stop >= len(marker) and tuple(tokens[stop - len(marker) : stop]) == marker
