"""Paged-engine benchmarks (docs/benchmarks/engine.md). Prints numbers and ratios measured in
one run against a baseline from the same run; asserts nothing.

  python benchmarks/engine_bench.py [--quick] [--only throughput,prefix,prefill,overhead]

- throughput: N prompts of 128-512 tokens, 128 output tokens each, ignore_eos: pdserve vs HF
  transformers static batching (one left-padded batch), same model, same threads.
  Both in float32, both in bfloat16, and each at its default on this CPU.
  Also the share of allocated KV slots holding real tokens, sampled every step.
- prefix: a 4,000-token shared prefix + 50 new tokens: prefill tokens computed, TTFT cached
  vs uncached.
- prefill: rounds of 16 prompts of 128-512 tokens (one output token), the bf16 prefill
  attention kernel off and on alternately in one process: median round, page faults.
- overhead: wall time per engine step outside the model forward, at 1 and 64 running sequences
  (median of 36 steps; random and greedy rows; --profile adds a cProfile of the 64-sequence
  random steps).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _run_pdserve(args, prompts, dtype: str) -> tuple[float, int, list[float], str]:
    """(seconds, output tokens, KV slot-usage samples, model dir) for one pdserve run."""
    llm = LLM(args.model, num_layers=args.num_layers, kv_cache_memory=args.kv_memory, dtype=dtype)
    engine = llm.engine
    usage: list[float] = []
    step = engine.step

    def sampling_step():
        deltas = step()
        running = engine.scheduler.running
        slots = sum(len(r.block_table) for r in running) * engine.block_manager.block_size
        if slots:
            usage.append(sum(r.num_computed_tokens for r in running) / slots)
        return deltas

    engine.step = sampling_step
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - t0
    return (
        seconds,
        sum(len(o.outputs[0].token_ids) for o in outs),
        usage,
        str(engine.loaded.model_dir),
    )


def _run_hf(args, prompts, model_dir: str, dtype: torch.dtype) -> tuple[float, int]:
    """HF transformers static batching: one left-padded batch, min = max new tokens."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        **({"num_hidden_layers": args.num_layers} if args.num_layers else {}),
    ).eval()
    width, pad = max(len(p) for p in prompts), 2
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            do_sample=False,
            pad_token_id=pad,
        )
    return time.perf_counter() - t0, (out.shape[1] - width) * len(prompts)


def bench_throughput(args) -> None:
    prompts = _prompts(args.num_prompts, 128, 512)
    print(
        f"\n== offline throughput: {len(prompts)} prompts of 128-512 tokens, {args.output_len} "
        f"out, ignore_eos, {args.threads} thread(s) =="
    )
    rates = {}
    for dtype in args.dtypes.split(","):
        seconds, generated, usage, model_dir = _run_pdserve(args, prompts, dtype)
        rates[("pdserve", dtype)] = generated / seconds
        print(f"pdserve {dtype:9s}: {seconds:7.1f} s {generated / seconds:8.1f} output tok/s")
        if usage and dtype == args.dtypes.split(",")[0]:
            mean = sum(usage) / len(usage)
            print(
                f"  KV slots holding real tokens: mean {mean:.1%} over {len(usage)} steps, "
                f"min {min(usage):.1%}  (target >= 95%)"
            )
        seconds, generated = _run_hf(args, prompts, model_dir, getattr(torch, dtype))
        rates[("hf", dtype)] = generated / seconds
        print(f"HF static {dtype:7s}: {seconds:7.1f} s {generated / seconds:8.1f} output tok/s")
    for dtype in args.dtypes.split(","):
        print(
            f"ratio pdserve/HF, both {dtype}: "
            f"{rates[('pdserve', dtype)] / rates[('hf', dtype)]:.2f}x"
        )
    if ("pdserve", "bfloat16") in rates and ("hf", "float32") in rates:
        print(
            f"ratio pdserve bfloat16 / HF float32 (each at its default on this CPU): "
            f"{rates[('pdserve', 'bfloat16')] / rates[('hf', 'float32')]:.2f}x  (target >= 3x)"
        )


def bench_prefix(args) -> None:
    llm = LLM(args.model, num_layers=args.num_layers, kv_cache_memory=args.kv_memory)
    engine = llm.engine
    rng = random.Random(1)
    shared = [rng.randrange(100, 49000) for _ in range(args.prefix_len)]
    tails = [[rng.randrange(100, 49000) for _ in range(50)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def ttft(prompt):
        before = engine.stats().prompt_tokens
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - t0, engine.stats().prompt_tokens - before

    uncached_s, uncached_tokens = ttft(shared + tails[0])
    cached_s, cached_tokens = ttft(shared + tails[1])
    engine.reset_prefix_cache()
    cold_s, _ = ttft(shared + tails[2])
    print(f"\n== prefix cache: {args.prefix_len}-token shared prefix + 50 new tokens ==")
    print(
        f"prefill tokens computed: uncached {uncached_tokens}, cached {cached_tokens}  "
        "(target <= 64)"
    )
    print(
        f"TTFT uncached {uncached_s * 1000:.0f} ms (after reset: {cold_s * 1000:.0f} ms), "
        f"cached {cached_s * 1000:.0f} ms, ratio {cached_s / uncached_s:.3f}  (target <= 0.05)"
    )


def bench_prefill(args) -> None:
    """Rounds of `--prefill-prompts` prompts of 128-512 tokens, one output token each (prefill
    steps only), the bf16 prefill attention kernel off and on alternately in one process
    (`cpu_kernels.prefills_in_place` forced False for "off"; where the kernel is not built
    both arms run gather + SDPA): median round time and page faults per round."""
    import resource

    from engine import cpu_kernels

    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model, num_layers=args.num_layers, kv_cache_memory=args.kv_memory, dtype="bfloat16"
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    built = cpu_kernels.prefills_in_place
    runs: dict[str, list[tuple[float, int]]] = {"off": [], "on": []}
    for round_ in range(2 + 2 * args.rounds):
        arm = "off" if round_ % 2 == 0 else "on"
        cpu_kernels.prefills_in_place = built if arm == "on" else (lambda *a: False)
        for i, p in enumerate(_prompts(args.prefill_prompts, 128, 512, seed=round_)):
            engine.add_request(f"pre-{round_}-{i}", p, params)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if round_ >= 2:  # the first pair warms up
            runs[arm].append(
                (
                    time.perf_counter() - t0,
                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                )
            )
    cpu_kernels.prefills_in_place = built
    print(
        f"\n== prefill rounds: {args.prefill_prompts} prompts of 128-512 tokens, bf16, "
        f"{args.threads} threads =="
    )
    built_isa = (
        torch.ops.pdserve_cpu.prefill_isa()
        if hasattr(torch.ops.pdserve_cpu, "prefill_isa")
        else "not built"
    )
    print(f"prefill kernel: {built_isa}")
    med = {arm: statistics.median(t for t, _ in r) for arm, r in runs.items()}
    for arm, r in runs.items():
        print(
            f"kernel {arm:3s}: median round {med[arm] * 1e3:7.1f} ms, "
            f"page faults per round {statistics.median(f for _, f in r):.0f}"
        )
    print(f"ratio on/off: {med['on'] / med['off']:.2f}")


def bench_overhead(args) -> None:
    """Wall time per step minus the wall time inside the model (`residual` + `logits`), at
    `--threads` torch threads: the engine's own work (scheduling, batch building, sampling,
    output processing) that a faster forward would not remove."""
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, num_layers=args.num_layers, kv_cache_memory=args.kv_memory)
    engine = llm.engine
    model = engine.loaded.model
    forward_time = [0.0]
    # `logits` calls `head_logits` (the LM head before the fp32 copy; what the runner calls
    # when the sampler reads the head's dtype): only the outermost call is counted.
    names = [n for n in ("residual", "logits", "head_logits") if hasattr(model, n)]
    originals = {name: getattr(model, name) for name in names}
    depth = [0]

    def timed(fn):
        def wrapper(*a, **k):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    forward_time[0] += time.perf_counter() - t0

        return wrapper

    for name, fn in originals.items():
        setattr(model, name, timed(fn))
    print(
        f"\n== step overhead: wall time per step outside the model forward ({args.threads} "
        "threads) =="
    )
    for batch in (1, 64):
        for greedy in (False, True):
            steps = 36
            params = SamplingParams(
                max_tokens=steps + 4, ignore_eos=True, temperature=0.0 if greedy else 1.0
            )
            for i, p in enumerate(_prompts(batch, 16, 16, seed=batch)):
                engine.add_request(f"ovh-{batch}-{i}", p, params)
            engine.step()  # prefill
            engine.step()  # first decode step (warm-up)
            profiler = cProfile.Profile() if args.profile and batch == 64 and not greedy else None
            outside, inside = [], []
            if profiler is not None:
                profiler.enable()
            for _ in range(steps):
                forward_time[0] = 0.0
                t0 = time.perf_counter()
                engine.step()
                outside.append(time.perf_counter() - t0 - forward_time[0])
                inside.append(forward_time[0])
            if profiler is not None:
                profiler.disable()
            # Medians per step: a step that a busy neighbour (steal) slowed does not move them.
            print(
                f"{batch:3d} running, {'greedy' if greedy else 'random'}: "
                f"{statistics.median(outside) * 1000:6.2f} ms/step outside forward "
                f"(mean {statistics.fmean(outside) * 1000:.2f}), "
                f"{statistics.median(inside) * 1000:7.2f} ms/step in forward"
            )
            for i in range(batch):
                engine.abort_request(f"ovh-{batch}-{i}")
            if profiler is not None:
                print(f"   where the time goes (cProfile, {steps} steps, by own time):")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    for name, fn in originals.items():
        setattr(model, name, fn)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=4000)
    parser.add_argument("--kv-memory", type=int, default=3 << 30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small sizes, 4 layers: a smoke run")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="engine/HF dtypes to compare")
    parser.add_argument("--only", default="throughput,prefix,prefill,overhead")
    parser.add_argument(
        "--prefill-prompts", type=int, default=16, help="prefill: prompts per round"
    )
    parser.add_argument("--rounds", type=int, default=4, help="prefill: rounds per arm")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="overhead: also print a cProfile of the 64-sequence random steps",
    )
    args = parser.parse_args()
    if args.quick:
        args.num_layers, args.num_prompts, args.output_len, args.prefix_len = 4, 8, 16, 500
    torch.set_num_threads(args.threads)
    which = set(args.only.split(","))
    if "throughput" in which:
        bench_throughput(args)
    if "prefix" in which:
        bench_prefix(args)
    if "prefill" in which:
        bench_prefill(args)
    if "overhead" in which:
        bench_overhead(args)


if __name__ == "__main__":
    main()
