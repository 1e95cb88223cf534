"""What compiling a constraint in a killable child process costs (docs/structured_outputs.md: a
worker's compile time limit), against compiling it in the request's thread: the same
GrammarCompiler, once with `--grammar-compile-timeout 0` (in-thread) and once with the default
(the child compiles, serializes the grammar, sends it over a socket; the worker rebuilds it).
Cold compiles only (a fresh constraint each rep: the cache never goes to the child), medians of
`--reps`, and the child's start (the first structured request after a worker starts, or after a
kill). Prints numbers; asserts nothing.

`--router` (issue 51) measures instead what the router's fair, bounded compile path costs per
request against the path it replaced (a FIFO of executor threads), in the same run: the
process's CPU time per `Grammars.check` (all threads), on a cache hit and on a miss whose
compile is stubbed out (returns at once, so only the router's own work is timed: the
repetition scan, the key's compile bucket, the slot's turn, the executor hop, the charge);
the repetition scan alone; and the wait of one key's benign constraint behind another key's
three compiles of `--stub-compile-s` each (FIFO: all three; fair: the one running).

  python benchmarks/grammar_compile_bench.py [--model default] [--reps 15]
  python benchmarks/grammar_compile_bench.py --router [--requests 2000] [--stub-compile-s 0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from structured_bench import COMPILE_SCHEMAS

from engine.models.prepare import resolve_model_path
from engine.processing.tokenizer import Tokenizer
from engine.structured.compile_process import CompileLimits
from engine.structured.compiler import GrammarCompiler
from engine.structured.params import StructuredOutputsParams
from engine.structured.repetition import repetition_bound
from router.generation.structured import Constraint, Grammars
from router.http.key_limits import KeyLimits

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


class _FifoGrammars:
    """The router's compile check before issue 51: the cache, then a FIFO of executor threads
    (one per compile process), no turns, no bound, no accounting."""

    def __init__(self, compile_fn) -> None:
        self._compile = compile_fn
        self._lock = threading.Lock()
        self._results: OrderedDict[tuple, str | None] = OrderedDict()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    async def check(self, c: Constraint, tenant: bytes | None = None) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self._check, c)

    def _check(self, c: Constraint) -> None:
        key = c.params.key()
        with self._lock:
            known = key in self._results
        if not known:
            refusal = self._compile(c.params)
            with self._lock:
                self._results[key] = refusal
                while len(self._results) > 4096:
                    self._results.popitem(last=False)


def _constraint(i: int) -> Constraint:
    schema = {**TYPICAL, "title": f"t{i}"}  # a fresh cache key, the typical schema's size
    return Constraint(StructuredOutputsParams(json=schema), "response_format")


async def _cpu_us(check, constraints: list[Constraint], tenant: bytes) -> float:
    """Process CPU (all threads) per `check`, sequential requests."""
    t0 = time.process_time()
    for c in constraints:
        await check(c, tenant)
    return (time.process_time() - t0) / len(constraints) * 1e6


async def _benign_wait(grammars, stub_s: float) -> tuple[float, int]:
    """(seconds the benign key waited, compiles that ran before its own) behind another key's
    three distinct compiles of `stub_s` each."""
    ran: list[str] = []

    def compile_fn(params, spent=None):
        ran.append(params.regex)
        if params.regex.startswith("slow"):
            time.sleep(stub_s)
        return None

    grammars._compile = compile_fn
    pile = []
    for i in range(3):
        c = Constraint(StructuredOutputsParams(regex=f"slow{i}[a-z]+"), "guided_regex")
        pile.append(asyncio.ensure_future(grammars.check(c, b"A" * 32)))
        await asyncio.sleep(0.01)  # queued in this order
    t0 = time.monotonic()
    await grammars.check(
        Constraint(StructuredOutputsParams(regex="[0-9]{3}"), "guided_regex"), b"B" * 32
    )
    waited = time.monotonic() - t0
    await asyncio.gather(*pile)
    return waited, ran.index("[0-9]{3}")


async def _router(tok: Tokenizer, requests: int, stub_s: float) -> None:
    def stub(params, spent=None):  # a compile that takes no time: only the router is timed
        return None

    fair = Grammars(tok, tok.vocab_size, key_limits=KeyLimits(0, 0, compile_seconds_per_minute=60))
    fair._compile = stub  # type: ignore[method-assign]
    fifo = _FifoGrammars(stub)
    rounds: dict[str, list[float]] = {"fifo": [], "fair": []}
    for r in range(5):  # interleaved rounds, medians
        for name, g in (("fifo", fifo), ("fair", fair)):
            batch = [
                _constraint(r * 10 * requests + i + (0 if name == "fifo" else 5 * requests))
                for i in range(requests)
            ]
            rounds[name].append(await _cpu_us(g.check, batch, b"K" * 32))
    hit: dict[str, float] = {}
    for name, g in (("fifo", fifo), ("fair", fair)):
        c = _constraint(-1)
        await g.check(c, b"K" * 32)
        hit[name] = statistics.median(
            [await _cpu_us(g.check, [c] * requests, b"K" * 32) for _ in range(5)]
        )
    miss = {name: statistics.median(v) for name, v in rounds.items()}
    print(f"{requests} sequential requests x 5 interleaved rounds, medians; process CPU per check")
    print(f"{'path':6s} {'miss us':>9s} {'hit us':>8s}")
    for name in ("fifo", "fair"):
        print(f"{name:6s} {miss[name]:>9.1f} {hit[name]:>8.2f}")
    print(
        f"ratio fair/fifo: miss {miss['fair'] / miss['fifo']:.2f}, "
        f"hit {hit['fair'] / hit['fifo']:.2f}"
    )
    typical = StructuredOutputsParams(json=TYPICAL)
    big = StructuredOutputsParams(regex="[A-Z][a-z]{2,6}-[0-9]{2,3}" * 630)  # ~16 KiB
    for name, params in (("typical schema", typical), (f"{big.num_bytes()} B regex", big)):
        t0 = time.process_time()
        for _ in range(200):
            repetition_bound(params)
        print(f"repetition scan, {name}: {(time.process_time() - t0) / 200 * 1e6:.1f} us")
    for name, g in (
        ("fifo", _FifoGrammars(stub)),
        ("fair", Grammars(tok, tok.vocab_size)),
    ):
        waited, before = await _benign_wait(g, stub_s)
        print(
            f"{name}: benign key waited {waited:.2f} s behind 3 x {stub_s:g} s compiles of "
            f"another key ({before} compiles ran before its own)"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--router", action="store_true", help="the router's compile path")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--stub-compile-s", type=float, default=0.3)
    args = parser.parse_args(argv)
    tok = Tokenizer.from_dir(resolve_model_path(args.model))
    if args.router:
        print(f"{platform.processor() or platform.machine()}, router compile path")
        asyncio.run(_router(tok, args.requests, args.stub_compile_s))
        return
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
