"""What a model's output can cost the router's parsers (issue 51), which run on its event loop:

- Work is linear in the text. For every registered tool parser, tool_choice "required"'s
  reader and every reasoning parser, a 100k-character argument (or held name, or reasoning)
  that never ends, fed in 1-8 character pieces, costs about 10x what a 10k one costs. A
  parser that rescans what it holds on every piece costs ~100x; the bound is 30x. Both sizes
  are timed in this test (no wall-clock bound), and the big run is abandoned as soon as it
  passes the bound, so a quadratic parser fails fast.
- `MAX_CALL_CHARS`: a call that runs past it ends tool call parsing: the call is finished as
  far as it was valid (broken), held text and the rest of the output are content, in pieces
  as whole; nothing raises.
- pythonic: a value whose evaluation raises (deep nesting: MemoryError, SyntaxError,
  RecursionError) is no literal, and its text is content.
"""

import random
import time
from typing import Callable

import pytest
from test_tool_parsers import CASES, FRAGMENTS, TOOLS, _check_call_pieces, _result, _splits

from router.parsers.feeding import FILLER, endless_pieces
from router.parsers.message import RequiredCallsReader
from router.parsers.reasoning.parser import reasoning_parser, reasoning_parser_names
from router.parsers.tools.base import ToolParser
from router.parsers.tools.parser import tool_parser, tool_parser_names
from router.parsers.tools.stream import StreamingToolParser
from router.parsers.tools.types import ParsedDelta, assemble

# Each reader's text up to an argument string (or a name) that the output never ends.
ARGUMENT = {
    "granite": '<|tool_call|>[{"name": "get_time", "arguments": {"s": "',
    "hermes": '<tool_call>\n{"name": "get_time", "arguments": {"s": "',
    "llama3_json": '{"name": "get_time", "parameters": {"s": "',
    "mistral": '[TOOL_CALLS]get_time[ARGS]{"s": "',
    "pythonic": '[get_time(s="',
    "required": '[{"name": "get_time", "parameters": {"s": "',
}
HELD_NAME = {
    "granite": '<|tool_call|>[{"name": "get_',
    "hermes": '<tool_call>\n{"name": "get_',
    "llama3_json": '{"name": "get_',
    "mistral": "[TOOL_CALLS]get_",
    "pythonic": "[get_",
    "required": '[{"name": "get_',
}
BOUND = 30  # the 100k text's time over the 10k text's: ~10 when linear, ~100 when quadratic


def _readers() -> list[tuple[str, str]]:
    out = [(name, shape) for name in tool_parser_names() for shape in ("argument", "name")]
    out += [("required", "argument"), ("required", "name")]
    return out + [(f"reasoning:{name}", "reasoning") for name in reasoning_parser_names()]


def _make(name: str) -> Callable[[], ToolParser]:
    if name.startswith("reasoning:"):
        return reasoning_parser(name.removeprefix("reasoning:"))  # type: ignore[return-value]
    if name == "required":
        return lambda: RequiredCallsReader(TOOLS)
    return lambda: tool_parser(name)(TOOLS)


def _timed(make: Callable[[], ToolParser], pieces: list[str], budget: float):
    """Seconds to feed `pieces` and finish, and the deltas; inf (None) once past `budget`."""
    parser, deltas = make(), []
    start = time.perf_counter()
    for i, piece in enumerate(pieces):
        deltas.append(parser.feed(piece))
        if i % 256 == 0 and time.perf_counter() - start > budget:
            return float("inf"), None
    deltas.append(parser.finish())
    return time.perf_counter() - start, deltas


@pytest.mark.parametrize("name,shape", _readers(), ids=lambda v: str(v))
def test_work_is_linear_in_an_endless_call(name, shape):
    reader = name.removeprefix("reasoning:")
    if shape == "reasoning":
        opening, filler = "<think>", FILLER
    else:
        assert reader in ARGUMENT, f"no long-argument text for tool parser {reader!r}: add one"
        opening = (ARGUMENT if shape == "argument" else HELD_NAME)[reader]
        filler = FILLER if shape == "argument" else "abcd_efgh_"
    make = _make(name)
    small = min(
        _timed(make, endless_pieces(opening, 10_000, filler), float("inf"))[0] for _ in range(3)
    )
    for _ in range(3):  # a busy machine may slow one run: any of three within the bound
        big, deltas = _timed(make, endless_pieces(opening, 100_000, filler), BOUND * small)
        if deltas is not None:
            break
    assert deltas is not None, f"100k characters cost over {BOUND}x what 10k cost"
    text = (filler * (100_000 // len(filler) + 1))[:100_000]
    content = "".join(d.content for d in deltas)
    calls = assemble([c for d in deltas for c in d.tool_calls])
    if shape == "reasoning":
        assert "".join(d.reasoning for d in deltas) == text and not content
    elif shape == "name":  # the name never ended: no call, all of it content
        assert content == opening + text and not calls
    elif reader == "pythonic":  # the value never ended: the call is finished without it
        assert [(c.name, c.arguments) for c in calls] == [("get_time", "")] and not content
    else:
        assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"s": "' + text)]


LIMIT = 60

# (reader, text): a call whose text runs past LIMIT, then a call that would parse.
PAST_THE_LIMIT = {
    "granite": '<|tool_call|>[{"name": "get_time", "arguments": {"s": "%s"}}]',
    "hermes": '<tool_call>\n{"name": "get_time", "arguments": {"s": "%s"}}\n</tool_call>',
    "llama3_json": '{"name": "get_time", "parameters": {"s": "%s"}}',
    "mistral": '[TOOL_CALLS]get_time[ARGS]{"s": "%s"}',
    "pythonic": '[get_time(a=1, b="%s")]',
    "required": '[{"name": "get_time", "parameters": {"s": "%s"}}]',
}


def _limited(name: str, monkeypatch) -> type[StreamingToolParser]:
    cls = RequiredCallsReader if name == "required" else tool_parser(name)
    assert issubclass(cls, StreamingToolParser)
    monkeypatch.setattr(cls, "MAX_CALL_CHARS", LIMIT)
    return cls


def _feed(cls: type[StreamingToolParser], pieces: list[str]) -> tuple[list[ParsedDelta], bool]:
    parser = cls(TOOLS)
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish())
    return deltas, parser.broken


@pytest.mark.parametrize("name", [*tool_parser_names(), "required"])
def test_a_call_past_the_limit_ends_tool_call_parsing(name, monkeypatch):
    cls = _limited(name, monkeypatch)
    call = PAST_THE_LIMIT[name]
    text = "Before. " + call % ("x" * 100) + " after " + call % "short"
    whole = _feed(cls, [text])
    content, calls = _result(whole[0])
    assert whole[1] and [n for n, _ in calls] == ["get_time"]  # one call, broken
    mark = len("Before. ")
    if name == "pythonic":  # the unfinished argument's text is content again
        assert calls[0][1] == '{"a": 1'
        assert content == "Before. " + text[text.index("b=") :]
    else:  # the arguments as far as the limit, then the rest as content
        assert content == "Before. " + text[mark + LIMIT :]
        assert text.endswith(calls[0][1] + text[mark + LIMIT :])
    for split, pieces in _splits(text).items():
        deltas, broken = _feed(cls, pieces)
        assert (_result(deltas), broken) == (_result(whole[0]), whole[1]), split
        _check_call_pieces(deltas, complete=False)


@pytest.mark.parametrize("name", [*tool_parser_names(), "required"])
def test_held_text_past_the_limit_is_content(name, monkeypatch):
    cls = _limited(name, monkeypatch)
    text = "Hi " + HELD_NAME[name] + "x" * 100 + "(" + PAST_THE_LIMIT[name] % "y"
    for pieces in [[text], *_splits(text).values()]:
        deltas, broken = _feed(cls, pieces)
        assert _result(deltas) == (text, []) and not broken


@pytest.mark.parametrize("name", [*tool_parser_names(), "required"])
def test_under_a_limit_texts_stream_as_they_parse_whole(name, monkeypatch):
    """The fixtures and mutated texts, each call cut at LIMIT // 2 characters."""
    cls = _limited(name, monkeypatch)
    monkeypatch.setattr(cls, "MAX_CALL_CHARS", LIMIT // 2)
    texts = [case[2] for case in CASES if case[0] == (name if name != "required" else "granite")]
    rng = random.Random(2)
    for _ in range(60):
        parts = [rng.choice(texts) for _ in range(rng.randrange(1, 4))]
        parts.insert(rng.randrange(len(parts) + 1), rng.choice(FRAGMENTS))
        text = "".join(parts)
        whole = _feed(cls, [text])
        for split, pieces in _splits(text).items():
            deltas, broken = _feed(cls, pieces)
            assert (_result(deltas), broken) == (_result(whole[0]), whole[1]), (split, text)


@pytest.mark.parametrize(
    "value",
    [
        "-" * 100_000 + "1",  # MemoryError (the parser's stack)
        "[" * 300 + "]" * 300 + "+x",  # SyntaxError (too many nested parentheses)
        "[" * 90 + "]" * 90,  # deep, but a literal
        "1" + "+1j" * 3000,  # RecursionError (during ast construction)
        "{" * 100 + "}" * 100,  # TypeError (unhashable dict)
        "9" * 5000,  # SyntaxError (too many digits)
        "{1, 2}",  # a set: no JSON form
    ],
    ids=["unary", "brackets", "lists", "additions", "dicts", "digits", "set"],
)
def test_pythonic_values_whose_evaluation_raises_are_content(value):
    text = f"[get_time(a=1, b={value})] done"
    for pieces in ([text], [text[i : i + 7] for i in range(0, len(text), 7)]):
        parser = tool_parser("pythonic")(TOOLS)
        deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
        content, calls = _result(deltas)
        if value == "[" * 90 + "]" * 90:  # a literal after all
            assert calls[0][1].startswith('{"a": 1, "b": [[[') and content == " done"
        else:
            assert calls == [("get_time", '{"a": 1')] and parser.broken
            assert content == f"{value})] done"
