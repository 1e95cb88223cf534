"""Structured-outputs benchmark (docs/structured_outputs.md). Per-step cost of constrained
decoding against unconstrained decoding of the same batch, measured in one run, interleaved;
and grammar compile time, cold and cached. Prints numbers and ratios; asserts nothing.

  python benchmarks/structured_bench.py [--batches 1,16,64] [--steps 24] [--reps 2]

Each batch of B requests decodes `--steps` steps after every request has its first token
(prefill excluded), with and without a JSON schema constraint (a list of short strings, long
enough never to complete within the steps; unconstrained rows use ignore_eos so both sides
decode every step). The step time difference is what the constraint costs: the matcher's
mask for every constrained row, its application to the logits and advancing the matcher.
The mask part alone is also timed (engine.sampling.logits_masks.apply_grammar_masks).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import engine.sampling.logits_masks as logits_masks
from engine import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 400}
    },
    "required": ["items"],
}
COMPILE_SCHEMAS = [
    SCHEMA,
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
            "address": {"$ref": "#/$defs/address"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1},
        },
        "required": ["name", "age", "address"],
        "$defs": {
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city"],
            }
        },
    },
]
PROMPT = "List some things you would take on a camping trip, as JSON:"


class _MaskTimer:
    """Wraps apply_grammar_masks to sum the time spent in it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inner = logits_masks.apply_grammar_masks

    def __call__(self, logits, rows):
        t0 = time.perf_counter()
        self._inner(logits, rows)
        self.seconds += time.perf_counter() - t0


def _step_time(
    llm: LLM, batch: int, steps: int, constrained: bool, timer: _MaskTimer
) -> tuple[float, float]:
    """(seconds per decode step, seconds per step in mask computation) for one batch."""
    engine = llm.engine
    params = SamplingParams(
        temperature=0.8,
        seed=1,
        max_tokens=steps + 2,
        ignore_eos=not constrained,
        structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}
        if constrained
        else None,
    )
    for i in range(batch):
        engine.add_request(f"{constrained}-{batch}-{i}-{time.monotonic_ns()}", PROMPT, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    timer.seconds = 0.0
    t0 = time.perf_counter()
    done = 0
    while engine.has_unfinished_requests() and done < steps:
        engine.step()
        done += 1
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / done, timer.seconds / done


def _compile_times() -> list[tuple[str, float, float]]:
    from engine.models.loader import load_model
    from engine.structured.compiler import GrammarCompiler
    from engine.structured.params import StructuredOutputsParams

    loaded = load_model("default", torch.float32, "cpu", num_layers=1)
    t0 = time.perf_counter()
    compiler = GrammarCompiler(
        loaded.tokenizer, loaded.args.vocab_size, loaded.tokenizer.stop_token_ids
    )
    rows = [("vocabulary index (once per process)", time.perf_counter() - t0, 0.0)]
    for i, schema in enumerate(COMPILE_SCHEMAS):
        params = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        compiler.compile(params)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=json.dumps(schema)))  # same content
        rows.append((f"json schema {i + 1}", cold, time.perf_counter() - t0))
    for name, p in (
        ("regex", StructuredOutputsParams(regex=r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}")),
        ("choice (3)", StructuredOutputsParams(choice=["positive", "negative", "neutral"])),
    ):
        t0 = time.perf_counter()
        compiler.compile(p)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile(p)
        rows.append((name, cold, time.perf_counter() - t0))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    for name, cold, cached in _compile_times():
        print(f"compile {name:38s} cold {cold * 1000:8.2f} ms   cached {cached * 1000:7.3f} ms")

    timer = _MaskTimer()
    logits_masks.apply_grammar_masks = timer
    llm = LLM(args.model, dtype=args.dtype, num_layers=args.num_layers, kv_cache_memory=1 << 30)
    _step_time(llm, 2, 2, True, timer)  # warm-up: compile, first forwards
    print(
        f"\ndtype {llm.engine.dtype}, {args.threads} thread(s), {args.steps} decode steps per run, "
        f"{args.reps} interleaved reps"
    )
    print(
        f"{'batch':>5} {'plain ms/step':>14} {'constrained':>12} {'overhead':>9} "
        f"{'mask ms/step':>13}"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        plain, constrained, mask = [], [], []
        for _ in range(args.reps):
            plain.append(_step_time(llm, batch, args.steps, False, timer)[0])
            c, m = _step_time(llm, batch, args.steps, True, timer)
            constrained.append(c)
            mask.append(m)
        p, c, m = min(plain), min(constrained), min(mask)
        print(
            f"{batch:>5} {p * 1000:>14.1f} {c * 1000:>12.1f} {(c / p - 1) * 100:>8.1f}% "
            f"{m * 1000:>13.2f}"
        )


if __name__ == "__main__":
    main()
