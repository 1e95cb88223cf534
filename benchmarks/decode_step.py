"""Where a small-batch decode step goes (docs/benchmarks/decode_profile.md). Prints, per
(dtype, threads, batch), the wall time of one engine decode step split into the forward's
projections, attention, the rest of the layers (norms, RoPE, residual adds), the LM head,
sampling, the runner's input preparation and the engine's own work outside `execute`
(scheduling, output processing, detokenizing). Asserts nothing.

  python benchmarks/decode_step.py [--dtypes bfloat16,float32] [--threads 1,2]
      [--batches 1,4,16] [--steps 10] [--torch-profile] [--compare VARIANT]

`--compare VARIANT` measures each case with the change off (baseline) and on, alternating
`--reps` times in the same process, and prints the step time ratio on/off (< 1 = faster).
Variants: `cpu_attention` (the C++ paged decode kernel vs gather + SDPA), `packed_linears`
(bf16 projections and LM head from oneDNN-packed weights vs F.linear), `both`.

Contexts are drawn in [--min-context, --max-context] per sequence (seeded); every sequence
is prefilled first, then `--steps` decode steps are timed after two warm-up steps. Timers
wrap the modules' `forward` (per-call `perf_counter`, a few µs each)."""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from engine import LLM, SamplingParams

PARTS = (
    "qkv",
    "o",
    "gate_up",
    "down",
    "attention",
    "norms/rope/other",
    "lm_head",
    "sampling",
    "input prep",
    "engine outside execute",
)


class StepTimers:
    """Per-part wall time, accumulated by wrappers around the engine's callables."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list = []

    def wrap(self, obj, attr: str, part: str) -> None:
        fn = getattr(obj, attr)
        seconds = self.seconds

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            seconds[part] += time.perf_counter() - t0
            return out

        had_own = attr in vars(obj)
        setattr(obj, attr, timed)
        self._undo.append((obj, attr, fn if had_own else None))

    def unwrap(self) -> None:
        for obj, attr, fn in reversed(self._undo):
            if fn is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, fn)
        self._undo.clear()


@contextmanager
def timed_engine(engine):
    """Timers on the engine's parts; yields the StepTimers."""
    timers = StepTimers()
    model, runner = engine.loaded.model, engine.runner
    for layer in model.layers:
        timers.wrap(layer.self_attn.qkv_proj, "forward", "qkv")
        timers.wrap(layer.self_attn.o_proj, "forward", "o")
        timers.wrap(layer.mlp.gate_up_proj, "forward", "gate_up")
        timers.wrap(layer.mlp.down_proj, "forward", "down")
    timers.wrap(runner.backend, "forward", "attention")
    timers.wrap(model, "residual", "residual")
    timers.wrap(model, "logits", "lm_head")
    timers.wrap(runner.sampler, "sample", "sampling")
    timers.wrap(runner, "execute", "execute")
    timers.wrap(engine, "step", "step")
    try:
        yield timers
    finally:
        timers.unwrap()


def parts_of(seconds: dict[str, float]) -> dict[str, float]:
    """The PARTS from the raw timer totals (nested timers subtracted)."""
    s = dict(seconds)
    inside = sum(s.get(k, 0.0) for k in ("qkv", "o", "gate_up", "down", "attention"))
    s["norms/rope/other"] = s.get("residual", 0.0) - inside
    s["input prep"] = (
        s.get("execute", 0.0)
        - s.get("residual", 0.0)
        - s.get("lm_head", 0.0)
        - s.get("sampling", 0.0)
    )
    s["engine outside execute"] = s.get("step", 0.0) - s.get("execute", 0.0)
    return {p: s.get(p, 0.0) for p in PARTS}


def prefilled_engine(args, dtype: str, batch: int, seed: int = 0):
    """An engine whose `batch` sequences (contexts drawn per sequence) are all decoding."""
    llm = LLM(
        args.model,
        num_layers=args.num_layers,
        kv_cache_memory=args.kv_memory,
        dtype=dtype,
        max_num_seqs=max(batch, 1),
        attention_backend=args.backend,
    )
    engine = llm.engine
    rng = random.Random(seed + batch)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(batch):
        n = args.max_context if batch == 1 else rng.randint(args.min_context, args.max_context)
        engine.add_request(f"dec-{i}", [rng.randrange(100, 49000) for _ in range(n)], params)
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    return llm


def measure(engine, steps: int) -> tuple[float, dict[str, float]]:
    """(ms per step, ms per step by part) over `steps` decode steps after two warm-ups."""
    engine.step()
    engine.step()
    with timed_engine(engine) as timers:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
    return total / steps * 1e3, {k: v / steps * 1e3 for k, v in parts_of(timers.seconds).items()}


def _cpu_attention(engine, on: bool) -> None:
    engine.runner.backend.cpu_kernels = on


def _packed_linears(engine, on: bool) -> None:
    from engine.models.layers import pack_linears

    pack_linears(engine.loaded.model, on)


def _both(engine, on: bool) -> None:
    _cpu_attention(engine, on)
    _packed_linears(engine, on)


VARIANTS = {"cpu_attention": _cpu_attention, "packed_linears": _packed_linears, "both": _both}


def compare(engine, variant: str, steps: int, reps: int) -> tuple[float, float, dict, dict]:
    """(baseline ms, variant ms, baseline parts, variant parts): medians over alternating reps."""
    toggle = VARIANTS[variant]
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(reps):
        for on in (False, True):
            toggle(engine, on)
            runs[on].append(measure(engine, steps))
    toggle(engine, False)
    med = {on: sorted(r, key=lambda x: x[0])[len(r) // 2] for on, r in runs.items()}
    return med[False][0], med[True][0], med[False][1], med[True][1]


def torch_profile(engine, steps: int, rows: int = 25) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def isa() -> str:
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    if "amx_bf16" in flags:
        return "AMX-BF16"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    return "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "SSE")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--min-context", type=int, default=256)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kv-memory", type=int, default=2 << 30)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--compare", choices=sorted(VARIANTS), default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--torch-profile", action="store_true", help="also print torch.profiler's op table per case"
    )
    args = parser.parse_args()
    print(
        f"ISA: {isa()}, torch {torch.__version__}, contexts {args.min_context}-{args.max_context} "
        f"(batch 1: {args.max_context})"
    )
    head = f"{'dtype':9s} {'thr':>3s} {'batch':>5s} {'step ms':>8s} | " + " | ".join(PARTS)
    print(head)
    for dtype in args.dtypes.split(","):
        for batch in map(int, args.batches.split(",")):
            torch.set_num_threads(2)
            llm = prefilled_engine(args, dtype, batch)
            for threads in map(int, args.threads.split(",")):
                torch.set_num_threads(threads)
                if args.compare:
                    base, new, base_parts, new_parts = compare(
                        llm.engine, args.compare, args.steps, args.reps
                    )
                    print(
                        f"{dtype:9s} {threads:3d} {batch:5d} {base:8.2f} -> {new:8.2f} ms "
                        f"ratio {new / base:.2f}  | "
                        + " | ".join(
                            f"{p} {base_parts[p]:.1f}->{new_parts[p]:.1f}"
                            for p in PARTS
                            if abs(base_parts[p] - new_parts[p]) > 0.2
                        ),
                        flush=True,
                    )
                    continue
                ms, parts = measure(llm.engine, args.steps)
                print(
                    f"{dtype:9s} {threads:3d} {batch:5d} {ms:8.2f} | "
                    + " | ".join(f"{parts[p]:.2f}" for p in PARTS),
                    flush=True,
                )
                if args.torch_profile:
                    torch_profile(llm.engine, args.steps)
            del llm


if __name__ == "__main__":
    main()
