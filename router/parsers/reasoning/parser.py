"""Choosing a reasoning parser by name (vLLM's `--reasoning-parser NAME`). The contract every
parser keeps is ReasoningParser's (router/parsers/reasoning/base.py, re-exported here with
`register_reasoning_parser`); the built-ins (router/parsers/reasoning/think.py) are registered on
import of this module."""
from __future__ import annotations

from router.parsers.reasoning import think as reasoning_parsers
from router.parsers.reasoning.base import _PARSERS, ReasoningParser, register_reasoning_parser

del reasoning_parsers  # imported for its effect: the built-in parsers registered themselves
__all__ = ["ReasoningParser", "reasoning_parser", "reasoning_parser_names",
           "register_reasoning_parser"]


def reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r} (known: "
                         f"{', '.join(sorted(_PARSERS))})") from None


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)
