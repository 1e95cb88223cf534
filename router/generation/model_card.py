"""What the router serves (`ModelCard`): one model's name, tokenizer, context length, sampling
defaults and how its chat output is read; built once by router/server.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.processing.tokenizer import Tokenizer
from router.parsers.message import ChatOptions


@dataclass(frozen=True)
class ModelCard:
    """What the router serves: one model, one tokenizer, one context length."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    aliases: frozenset[str] = frozenset()
    max_n: int = 128
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    """SamplingParams field -> value for requests that omit it
    (engine.processing.generation_config)."""
    chat: ChatOptions = field(default_factory=ChatOptions)
    """How chat output is read: tool calls, reasoning (the router's flags)."""
    longest_token_chars: int = field(init=False, repr=False, compare=False)
    """The longest vocabulary entry, in characters: a text longer than this x the context
    has more tokens than the context holds."""

    def __post_init__(self) -> None:
        tok = self.tokenizer
        object.__setattr__(
            self, "longest_token_chars", max(len(tok.token_str(i)) for i in range(tok.vocab_size))
        )
