"""Choosing a reasoning parser by name (vLLM's `--reasoning-parser NAME`). The contract every
parser keeps is ReasoningParser's (router/parsers/reasoning/base.py, re-exported here with
`register_reasoning_parser`); the built-ins (router/parsers/reasoning/think.py) are registered on
import of this module."""

from __future__ import annotations

from router.parsers.reasoning import think
from router.parsers.reasoning.base import (
    REASONING_PARSERS,
    ReasoningParser,
    register_reasoning_parser,
)

del think  # imported for its effect: the built-in parsers registered themselves
__all__ = [
    "ReasoningParser",
    "reasoning_parser",
    "reasoning_parser_names",
    "register_reasoning_parser",
]

reasoning_parser = REASONING_PARSERS.get
reasoning_parser_names = REASONING_PARSERS.names
