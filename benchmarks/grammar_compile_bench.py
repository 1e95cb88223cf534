"""What compiling a constraint in a killable child process costs (docs/structured_outputs.md: a
worker's compile time limit), against compiling it in the request's thread: the same
GrammarCompiler, once with `--grammar-compile-timeout 0` (in-thread) and once with the default
(the child compiles, serializes the grammar, sends it over a socket; the worker rebuilds it).
Cold compiles only (a fresh constraint each rep: the cache never goes to the child), medians of
`--reps`, and the child's start (the first structured request after a worker starts, or after a
kill). Prints numbers; asserts nothing.

  python benchmarks/grammar_compile_bench.py [--model default] [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from structured_bench import COMPILE_SCHEMAS

from engine.models.prepare import resolve_model_path
from engine.processing.tokenizer import Tokenizer
from engine.structured.compile_process import CompileLimits
from engine.structured.compiler import GrammarCompiler
from engine.structured.params import StructuredOutputsParams

SMALL = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TYPICAL = COMPILE_SCHEMAS[1]  # structured_bench's: $ref, bounds, patterns, an enum
CASES = {"small schema": SMALL, "typical schema": TYPICAL}


def _variant(schema: dict, i: int) -> StructuredOutputsParams:
    """`schema` with a unique title: same grammar, a new cache key."""
    return StructuredOutputsParams(json={**schema, "title": f"t{i}"})


def _cold_ms(compiler: GrammarCompiler, schema: dict, reps: int, base: int) -> float:
    times = []
    for i in range(reps):
        params = _variant(schema, base + i)
        t0 = time.perf_counter()
        compiler.compile(params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def _serialized_bytes(compiler: GrammarCompiler, schema: dict) -> int:
    return len(compiler.compile(_variant(schema, -1)).serialize_json())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    tok = Tokenizer.from_dir(resolve_model_path(args.model))
    vocab = tok.vocab_size
    in_thread = GrammarCompiler(tok, vocab, tok.stop_token_ids, CompileLimits(timeout_s=0))
    in_child = GrammarCompiler(tok, vocab, tok.stop_token_ids, CompileLimits(timeout_s=10.0))
    t0 = time.perf_counter()
    in_child.compile(StructuredOutputsParams(regex="[0-9]"))
    start_s = time.perf_counter() - t0
    print(
        f"{platform.processor() or platform.machine()}, vocabulary {vocab} tokens, "
        f"median of {args.reps} cold compiles"
    )
    print(f"child start (first compile after start or a kill): {start_s:.2f} s")
    print(
        f"{'constraint':16s} {'in-thread ms':>13s} {'child ms':>9s} {'added ms':>9s} "
        f"{'grammar bytes':>14s}"
    )
    for n, (name, schema) in enumerate(CASES.items()):
        base = n * 10 * args.reps
        _cold_ms(in_thread, schema, 2, base - 100)  # warm both paths
        _cold_ms(in_child, schema, 2, base - 200)
        a = _cold_ms(in_thread, schema, args.reps, base)
        b = _cold_ms(in_child, schema, args.reps, base + 5 * args.reps)
        print(
            f"{name:16s} {a:>13.2f} {b:>9.2f} {b - a:>9.2f} "
            f"{_serialized_bytes(in_thread, schema):>14d}"
        )
    again = StructuredOutputsParams(json=json.dumps(TYPICAL))
    in_child.compile(again)
    t0 = time.perf_counter()
    for _ in range(100):
        in_child.compile(again)
    print(f"cache hit (never goes to the child): {(time.perf_counter() - t0) * 10:.3f} ms")
    in_child.close()


if __name__ == "__main__":
    main()
