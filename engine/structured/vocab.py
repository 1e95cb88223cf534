"""What the grammar compiler needs of a tokenizer, torch- and xgrammar-free (the router imports
it; its compile processes get the result instead of the tokenizer)."""

from __future__ import annotations

from engine.processing.tokenizer import Tokenizer


def vocabulary(tokenizer: Tokenizer) -> list[bytes]:
    """Each token id's bytes, special tokens empty (never allowed inside a constrained
    output)."""
    return [
        b"" if tokenizer.is_special(i) else tokenizer.token_bytes(i)
        for i in range(tokenizer.vocab_size)
    ]
