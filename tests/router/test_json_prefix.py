"""The incremental JSON validator (router/parsers/tools/json_prefix.py) against Python's json
module:
every prefix of a valid document is accepted and the document completes exactly at its end,
in any pieces; an invalid document stops at the first character no valid document could
have there; random documents and their random mutations agree with `json.loads`."""

import json
import random

import pytest

from router.parsers.tools.json_prefix import JsonPrefix, valid_prefix

VALID = [
    "{}",
    "[]",
    '""',
    '{"a": 1}',
    ' {"a" : [1, -2.5e+3, 0, 0.25, 1E9, true, false, null]} ',
    '{"s": "q\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\uD83D\\uDE00 日本 🌧"}',
    '[[[]], {"a": {"b": [{}]}}, "x"]',
    '{"": ""}',
    "\n\t[1 ,\r 2]",
    '"\\u0041"',
    "true",
]
# (text, index of the first character that cannot continue a JSON value)
INVALID = [
    ('{"a": 01}', 7),
    ('{"a": 1,}', 8),
    ("{a: 1}", 1),
    ("{'a': 1}", 1),
    ("[1 2]", 3),
    ('{"a" 1}', 5),
    ('"\\x"', 2),
    ('"\\u12g4"', 5),
    ('"a\nb"', 2),
    ("[-]", 2),
    ("[1.]", 3),
    ("[1e]", 3),
    ("[.5]", 1),
    ("tru!", 3),
    ('{"a": 1}}', 8),
    ("[+1]", 1),
    ("{,}", 1),
    ("[1,]", 3),
    ("nul ", 3),
]


@pytest.mark.parametrize("text", VALID)
def test_valid_documents_complete_at_their_end(text):
    end = len(text.rstrip())
    assert valid_prefix(text) == (end, True)
    for cut in range(end):
        assert valid_prefix(text[:cut]) == (cut, False)
    validator = JsonPrefix()
    for c in text[:end]:  # one character at a time
        assert validator.feed(c) == 1
    assert validator.done and validator.feed(" ") == 0


def test_a_top_level_number_ends_at_the_next_character():
    assert valid_prefix("12") == (2, False)
    assert valid_prefix("12 ") == (2, True)
    assert valid_prefix("true") == (4, True)


@pytest.mark.parametrize("text,stop", INVALID)
def test_invalid_documents_stop_at_the_first_bad_character(text, stop):
    validator = JsonPrefix()
    assert validator.feed(text) == stop
    assert validator.failed or validator.done


def _document(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -1, 7, 123456789, 0.5, -2.25e-7, 1e300])
    if kind in (2, 3, 4):
        return "".join(rng.choice('ab"\\\n\t/é🌧\x01 ') for _ in range(rng.randrange(6)))
    if kind == 5:
        return [_document(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        _document(rng, 5) if rng.random() < 0.9 else "k": _document(rng, depth + 1)
        for _ in range(rng.randrange(4))
    }


def test_random_documents_and_mutations_agree_with_json():
    rng = random.Random(0)
    for _ in range(400):
        doc = {"x": _document(rng)}
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        assert valid_prefix(text) == (len(text), True)
        chars = list(text)
        for _ in range(rng.randrange(1, 3)):
            chars.insert(rng.randrange(len(chars)), rng.choice('{}[]",:0-e.\\ ax'))
        mutated = "".join(chars)
        end, done = valid_prefix(mutated)
        try:
            json.loads(mutated)
            parses = True
        except ValueError:
            parses = False
        assert (done and mutated[end:].strip() == "") == parses, mutated
