"""Tool call parsers (router/parsers/tools/) on a stream: a long answer in each format (prose with
calls between, arguments with long strings and nested values) fed in 4-character pieces,
about one token each. Prints microseconds per piece for each parser and its ratio to a
baseline measured in the same run: a pass-through that wraps each piece as content (the
least any parser returns). Every parser must find all the calls, in pieces as whole.

    python benchmarks/tool_parsers.py [--calls 40] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import time

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


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--calls", type=int, default=40)
    args.add_argument("--repeats", type=int, default=10)
    opts = args.parse_args()
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
