"""Reasoning output (vLLM's `--reasoning-parser NAME`): a reasoning model writes its thinking
between markers (`<think>` ... `</think>`) before the answer; the parser splits one
completion's text into `reasoning` and `content` as it streams.

Contract, for every parser (as for tool parsers, router/parsers/tools/base.py): `feed(text)`
returns what `text` adds, `finish()` what was held back; feeding the same text in any pieces
gives the same split; only a possible marker prefix is held back. `prompt_ends_reasoning`:
the rendered prompt already closed the reasoning (e.g. Qwen3 with `enable_thinking: false`
writes an empty `<think></think>`), so the whole output is answer; `prompt_starts_reasoning`:
the rendered prompt ends inside an open `<think>` (DeepSeek-R1's template, Qwen3.5's and the
Qwen3 2507 thinking models'), so the output begins as reasoning (`for_prompt` tells both
from the prompt's text). `start` / `end`: the marker texts, which the router turns into
token ids for the engine, whose structured-output grammar then applies to the answer only
(after the end marker).

This module holds the contract and the registry parsers add themselves to;
router/parsers/reasoning/parser.py selects from it by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from router.parsers.registry import ParserRegistry
from router.parsers.tools.types import ParsedDelta


class ReasoningParser(ABC):
    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def __init__(
        self, prompt_ends_reasoning: bool = False, prompt_starts_reasoning: bool = False
    ) -> None:
        self.prompt_ends_reasoning = prompt_ends_reasoning
        self.prompt_starts_reasoning = prompt_starts_reasoning

    @classmethod
    def for_prompt(cls, prompt: str) -> "ReasoningParser":
        """A parser for the output that follows the rendered `prompt`, whose end may have
        closed (`end`) or opened (`start`) the reasoning already."""
        tail = prompt.rstrip()
        return cls(
            prompt_ends_reasoning=tail.endswith(cls.end),
            prompt_starts_reasoning=tail.endswith(cls.start),
        )

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """What `text` adds: `reasoning` and/or `content` (never tool calls)."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The end of the output: what was held back."""

    @property
    @abstractmethod
    def in_answer(self) -> bool:
        """The reasoning is over: text fed from now on is answer."""


REASONING_PARSERS: ParserRegistry[type[ReasoningParser]] = ParserRegistry(
    "reasoning", "--reasoning-parser-plugin"
)
register_reasoning_parser = REASONING_PARSERS.register
