"""Tool call parsers (router/parsers/tools/) on a stream: a long answer in each format (prose with
calls between, arguments with long strings and nested values) fed in 4-character pieces,
about one token each. Prints microseconds per piece for each parser and its ratio to a
baseline measured in the same run: a pass-through that wraps each piece as content (the
least any parser returns). Every parser must find all the calls, in pieces as whole.

Then (unless `--no-long`) the scaling check of issue 51: one call whose last argument is a
string that never ends, `--long` characters of it (10k, 50k, 100k by default), fed in pieces
of 1-8 characters, for every tool parser, tool_choice "required"'s reader and every reasoning
parser (an unclosed `<think>`). Prints each size's milliseconds and its ratio to the
smallest size's: a parser whose work is linear in the text gives about the ratio of the
sizes (10x for 100k against 10k), one that rescans what it holds gives their square.

    python benchmarks/tool_parsers.py [--calls 40] [--repeats 10] [--long 10000 50000 100000]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

from router.parsers.feeding import endless_pieces
from router.parsers.message import RequiredCallsReader
from router.parsers.reasoning.parser import reasoning_parser, reasoning_parser_names
from router.parsers.tools.parser import tool_parser, tool_parser_names
from router.parsers.tools.types import FunctionTool, ParsedDelta, assemble

TOOLS = [FunctionTool("get_weather"), FunctionTool("search_docs")]
PROSE = (
    "Let me think about which tools help here; the forecast matters, and so do the "
    "docs (see section 4 < 5). "
)
ARGS = {
    "query": 'how do I configure the café\'s "blue" printer?\n' * 3,
    "filters": {"lang": ["en", "fr"], "year": 2024, "exact": True, "score": -0.5},
}


def _call(name: str, args: dict, fmt: str) -> str:
    text = json.dumps(args, ensure_ascii=False)
    if fmt == "hermes":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {text}}}\n</tool_call>'
    if fmt == "llama3_json":
        return f'{{"name": "{name}", "parameters": {text}}}'
    if fmt == "mistral":
        return f"[TOOL_CALLS]{name}[ARGS]{text}"
    if fmt == "granite":
        return f'<|tool_call|>[{{"name": "{name}", "arguments": {text}}}]'
    kwargs = ", ".join(f"{k}={v!r}" for k, v in args.items())
    return f"[{name}({kwargs})]"


def answer(fmt: str, calls: int) -> str:
    """Prose and `calls` calls, alternating."""
    names = [t.name for t in TOOLS]
    return "".join(PROSE * 3 + _call(names[i % 2], ARGS, fmt) for i in range(calls)) + PROSE


def _pieces(text: str) -> list[str]:
    return [text[i : i + 4] for i in range(0, len(text), 4)]


def _baseline(pieces: list[str]) -> list[ParsedDelta]:
    return [ParsedDelta(content=piece) for piece in pieces]


def _parse(fmt: str, pieces: list[str]) -> list[ParsedDelta]:
    parser = tool_parser(fmt)(TOOLS)
    out = [parser.feed(piece) for piece in pieces]
    out.append(parser.finish())
    return out


def _best_us(runs: list, pieces: list[str], repeats: int) -> list[float]:
    """Each of `runs`' best time over `pieces`, in microseconds per piece (the runs take
    turns, so a busy machine slows them alike)."""
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run(pieces)
            best[i] = min(best[i], time.perf_counter() - start)
    return [b / len(pieces) * 1e6 for b in best]


# -- one call with an argument that never ends (issue 51) ------------------------------------

OPENINGS = {
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "',
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "',
    "pythonic": '[get_weather(city="',
    "required": '[{"name": "get_weather", "parameters": {"city": "',
}


def _reader(name: str) -> Callable[[], ParsedDelta]:
    """A fresh parser's feed/finish for `name` ("tool:x", "reasoning:x", "required")."""
    kind, _, which = name.partition(":")
    if kind == "reasoning":
        return reasoning_parser(which)()  # type: ignore[return-value]
    if kind == "required":
        return RequiredCallsReader(TOOLS)  # type: ignore[return-value]
    return tool_parser(which)(TOOLS)  # type: ignore[return-value]


def _feed_all(name: str, pieces: list[str]) -> None:
    parser = _reader(name)
    for piece in pieces:
        parser.feed(piece)  # type: ignore[attr-defined]
    parser.finish()  # type: ignore[attr-defined]


def scaling(sizes: list[int], repeats: int) -> None:
    names = [f"tool:{n}" for n in tool_parser_names()] + ["required"]
    names += [f"reasoning:{n}" for n in reasoning_parser_names()]
    print(f"\n{'reader':<22}" + "".join(f"{f'{n // 1000}k ms':>10}" for n in sizes), end="")
    print("".join(f"{f'{n // 1000}k/{sizes[0] // 1000}k':>10}" for n in sizes[1:]))
    for name in names:
        kind, _, which = name.partition(":")
        opening = "<think>" if kind == "reasoning" else OPENINGS[which or kind]
        best = []
        for size in sizes:
            pieces = endless_pieces(opening, size)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                _feed_all(name, pieces)
                times.append(time.perf_counter() - start)
            best.append(min(times) * 1e3)
        cells = "".join(f"{b:>10.1f}" for b in best)
        ratios = "".join(f"{b / best[0]:>9.1f}x" for b in best[1:])
        print(f"{name:<22}{cells}{ratios}", flush=True)


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--calls", type=int, default=40)
    args.add_argument("--repeats", type=int, default=10)
    args.add_argument("--long", type=int, nargs="+", default=[10_000, 50_000, 100_000])
    args.add_argument("--long-repeats", type=int, default=3)
    args.add_argument("--no-long", action="store_true", help="skip the long-argument check")
    args.add_argument("--no-answers", action="store_true", help="only the long-argument check")
    opts = args.parse_args()
    if not opts.no_answers:
        answers(opts)
    if not opts.no_long:
        scaling(sorted(opts.long), opts.long_repeats)


def answers(opts: argparse.Namespace) -> None:
    print(f"{'parser':<12} {'chars':>7} {'pieces':>7} {'us/piece':>9} {'baseline':>9} {'ratio':>7}")
    for fmt in tool_parser_names():
        text = answer(fmt, opts.calls)
        pieces = _pieces(text)
        for deltas in (_parse(fmt, pieces), _parse(fmt, [text])):
            calls = assemble([d for delta in deltas for d in delta.tool_calls])
            assert len(calls) == opts.calls, (fmt, len(calls))
            assert all(json.loads(c.arguments) == ARGS for c in calls)
        base, us = _best_us([_baseline, lambda p: _parse(fmt, p)], pieces, opts.repeats)
        print(
            f"{fmt:<12} {len(text):>7} {len(pieces):>7} {us:>9.2f} {base:>9.2f} {us / base:>6.1f}x"
        )


if __name__ == "__main__":
    main()
