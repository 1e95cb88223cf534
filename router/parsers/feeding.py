"""A model's output as the parsers meet it on a stream: text cut into pieces of 1-8
characters (about one token each), the same cuts on every call. What the parsers' tests
(tests/router/test_parser_limits.py) and benchmarks/tool_parsers.py feed them, so that a
number measured there speaks of the same input a test checks."""

from __future__ import annotations

import random

#: Brackets and punctuation but no quote (a quote would end a JSON string): what an argument
#: or reasoning that the output never ends is made of.
FILLER = "lorem ipsum, (dolor) [sit] amet; "


def endless_pieces(opening: str, chars: int, filler: str = FILLER) -> list[str]:
    """`opening`, then `chars` characters of `filler` repeated (a string the output never
    ends), in pieces of 1-8 characters (random.Random(0): the same cuts every call)."""
    text = opening + (filler * (chars // len(filler) + 1))[:chars]
    rng, pieces, i = random.Random(0), [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        pieces.append(text[i : i + n])
        i += n
    return pieces
