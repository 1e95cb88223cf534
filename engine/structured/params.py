"""What a request asks its output to follow: vLLM's `StructuredOutputsParams` (its fields,
its names; the OpenAI `response_format` and vLLM's older `guided_*` fields map onto it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.checks import FieldError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    """A JSON schema (object or its text): the output is one JSON value valid against it."""
    regex: str | None = None
    """The output matches this regular expression (whole output)."""
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (GBNF dialect, root rule `root`; xgrammar's, as vLLM's default)."""
    json_object: bool | None = None
    """Any JSON object (OpenAI `response_format: {"type": "json_object"}`)."""
    structural_tag: str | None = None
    """xgrammar's structural tag (JSON text): free text with tagged, schema-bound regions."""
    disable_any_whitespace: bool = False
    """JSON without optional whitespace between tokens."""
    disable_additional_properties: bool = False
    """JSON objects may not carry properties the schema does not list (even when the schema
    allows them)."""
    disable_fallback: bool = False
    """Accepted for vLLM compatibility: there is one backend, nothing to fall back to."""
    reasoning_start: tuple[int, ...] | None = None
    """A reasoning model's start-of-thinking marker (`<think>`), as token ids: with
    `reasoning_end`, the constraint applies to the answer only (engine/structured/gate.py)."""
    reasoning_end: tuple[int, ...] | None = None
    """Its end-of-thinking marker (`</think>`), as token ids: the grammar starts on the token
    after it. Both markers or neither."""

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise FieldError(
                "structured_outputs",
                "structured_outputs needs exactly one of "
                f"{', '.join(KINDS)}; got {given or 'none'}",
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise FieldError("choice", "choice must be a non-empty list of non-empty strings")
        for name in ("reasoning_start", "reasoning_end"):
            ids = getattr(self, name)
            if ids is not None:
                ids = tuple(ids)
                object.__setattr__(self, name, ids)
                if not ids or not all(type(t) is int and t >= 0 for t in ids):
                    raise FieldError(
                        name, f"{name} must be a non-empty list of token ids, got {list(ids)}"
                    )
        if (self.reasoning_start is None) != (self.reasoning_end is None):
            raise FieldError(
                "reasoning_end" if self.reasoning_end is None else "reasoning_start",
                "reasoning_start and reasoning_end go together: both or neither",
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """Content identity (the compile cache's key): equal constraints compile once. The
        reasoning markers are not in it: they gate the grammar, they do not change it."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):  # key order kept: properties are generated in it
            value = json.dumps(value)
        return (self.kind, value, self.disable_any_whitespace, self.disable_additional_properties)

    def num_bytes(self) -> int:
        """The constraint's size, as the --max-grammar-bytes limits check it: its text (a
        schema as JSON), or the choices' total."""
        value = self.key()[1]
        if isinstance(value, tuple):
            return sum(len(choice.encode()) for choice in value)
        return len(value.encode()) if isinstance(value, str) else 0
