"""The built-in reasoning parsers (router/parsers/reasoning/base.py), by vLLM's names:

- `deepseek_r1`: the output begins inside the reasoning (the template already wrote
  `<think>`; a `<think>` the model writes first anyway is dropped). Everything up to
  `</think>` is reasoning, the rest answer; no `</think>` at all: all reasoning.
- `qwen3`: `<think>...</think>` is reasoning; output without any marker is all answer; a
  `</think>` without a start closes a reasoning the prompt opened: with
  `prompt_starts_reasoning` the text before it is reasoning. Without that flag the text
  before it has already gone out as answer (a parser holds back only marker prefixes), and
  only the marker is dropped.

Both: `prompt_ends_reasoning` makes the whole output answer; markers after the reasoning
ended are answer text."""

from __future__ import annotations

from enum import IntEnum

from router.parsers.markers import held_prefix
from router.parsers.reasoning.base import ReasoningParser, register_reasoning_parser
from router.parsers.tools.types import ParsedDelta


class Phase(IntEnum):
    """Where the output is, in the order it moves through them."""

    UNDECIDED = 0  # answer text, but a `<think>` may still open reasoning (qwen3)
    OPENING = 1  # reasoning, and a `<think>` here at the very start is dropped
    REASONING = 2
    ANSWER = 3


class ThinkParser(ReasoningParser):
    """`<think>` / `</think>` splitting from a starting phase (`_first_phase`)."""

    def __init__(
        self, prompt_ends_reasoning: bool = False, prompt_starts_reasoning: bool = False
    ) -> None:
        super().__init__(prompt_ends_reasoning, prompt_starts_reasoning)
        self._phase = Phase.ANSWER if prompt_ends_reasoning else self._first_phase()
        self._held = ""

    def _first_phase(self) -> Phase:
        return Phase.OPENING

    @property
    def in_answer(self) -> bool:
        return self._phase == Phase.ANSWER

    def feed(self, text: str) -> ParsedDelta:
        return self._split(self._held + text, final=False)

    def finish(self) -> ParsedDelta:
        return self._split(self._held, final=True)

    def _split(self, text: str, final: bool) -> ParsedDelta:
        out, self._held = ParsedDelta(), ""
        while text:
            phase = self._phase
            if phase == Phase.ANSWER:
                out.content += text
                break
            if phase == Phase.OPENING:
                if text.startswith(self.start):
                    text = text[len(self.start) :]
                elif self.start.startswith(text) and not final:
                    self._held = text
                    break
                self._phase = Phase.REASONING
                continue
            markers = (self.end,) if phase == Phase.REASONING else (self.start, self.end)
            found = [(i, m) for m in markers if (i := text.find(m)) != -1]
            if found:
                i, marker = min(found)
                before, text = text[:i], text[i + len(marker) :]
                self._phase = Phase.REASONING if marker == self.start else Phase.ANSWER
            else:
                cut = len(text) - (0 if final else held_prefix(text, 0, markers))
                before, self._held, text = text[:cut], text[cut:], ""
            if phase == Phase.REASONING:
                out.reasoning += before
            else:
                out.content += before
        return out


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkParser):
    pass


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ThinkParser):
    def _first_phase(self) -> Phase:
        return Phase.OPENING if self.prompt_starts_reasoning else Phase.UNDECIDED
