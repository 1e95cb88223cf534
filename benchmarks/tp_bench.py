"""Tensor parallelism on the CPU (docs/parallelism.md). Prints numbers; asserts nothing.

    python benchmarks/tp_bench.py engine      # TP=2 (1 thread/rank) vs TP=1 (2 threads), ~2 min
    python benchmarks/tp_bench.py allreduce   # gloo all-reduce cost per call, 2 processes

engine: the default model (bf16 where the CPU has native bf16), prefill throughput (the steps
of 4 prompts of 512 random tokens) and decode throughput (the decode-only steps of 8 sequences,
32 tokens each), both engines alive, measured round by round, best of --reps; the collectives
per decode step from rank 0's communicator.
allreduce: one all-reduce of [rows, 576] (the default model's width) in the model dtype, 2
ranks over gloo on loopback, median of 200 after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from cpu_info import cpu_isa


def _prefill_s(llm, prompts) -> float:
    """Seconds of the steps that prefill `prompts` (one output token each)."""
    from engine import SamplingParams

    llm.reset_prefix_cache()
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, SamplingParams(max_tokens=1, ignore_eos=True))
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t


def _decode_s(llm, prompts, tokens: int) -> tuple[float, int, int]:
    """(seconds, steps, collectives) of the decode-only steps of `prompts` generating
    `tokens` each."""
    from engine import SamplingParams

    llm.reset_prefix_cache()
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"d{i}", p, SamplingParams(max_tokens=tokens, ignore_eos=True))
    while eng.stats().num_waiting or eng.stats().queued_prefill_tokens:
        eng.step()  # prefill (and the first token)
    group = eng.parallel_group
    calls = group.comm.calls if group else 0
    steps, t = 0, time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    return time.perf_counter() - t, steps, (group.comm.calls - calls if group else 0)


def engine(reps: int) -> None:
    """Both engines alive at once, measured round by round (interleaved), best of `reps`."""
    from engine import LLM

    print(cpu_isa())
    torch.set_num_threads(2)
    common = dict(kv_cache_memory=256 << 20, max_num_batched_tokens=2048)
    one = LLM(**common)
    two = LLM(tensor_parallel_size=2, **common)  # 1 thread per rank (2 // 2), rank 0 set to 1
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, 512).tolist() for _ in range(4)]
    short = [rng.integers(100, 40000, 16).tolist() for _ in range(8)]
    best: dict[tuple[int, str], float] = {}
    calls = 0.0
    for _ in range(reps + 1):  # the first round warms up
        for tp, llm in ((1, one), (2, two)):
            torch.set_num_threads(2 if tp == 1 else 1)
            pre = 4 * 512 / _prefill_s(llm, prompts)
            secs, steps, collectives = _decode_s(llm, short, 33)
            if tp == 2:
                calls = collectives / steps
            dec = 8 * steps / secs
            best[tp, "prefill"] = max(best.get((tp, "prefill"), 0.0), pre)
            best[tp, "decode"] = max(best.get((tp, "decode"), 0.0), dec)
    for key in ("prefill", "decode"):
        print(
            f"{key} tok/s: TP=1 (2 threads) {best[1, key]:.0f}  TP=2 (1 thread/rank) "
            f"{best[2, key]:.0f}  ratio {best[2, key] / best[1, key]:.2f}"
        )
    print(f"collectives per decode step at TP=2: {calls:.0f} (+ 2 payload broadcasts)")
    two.close()


def _allreduce_rank(rank: int, port: int, dtype: torch.dtype, rows: list[int], out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for n in rows:
        x = torch.randn(n, 576).to(dtype)
        for _ in range(20):
            dist.all_reduce(x)
        times = []
        for _ in range(200):
            t = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t)
        if rank == 0:
            out[n] = statistics.median(times)
    dist.destroy_process_group()


def allreduce(dtype: torch.dtype) -> None:
    import torch.multiprocessing as mp

    from engine.parallel.group import free_port

    print(cpu_isa())
    rows = [1, 8, 64, 512, 2048]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_allreduce_rank, args=(free_port(), dtype, rows, out), nprocs=2)
        for n in rows:
            print(
                f"all-reduce [{n}, 576] {dtype}: {out[n] * 1e6:.0f} us/call, "
                f"x62 per step = {out[n] * 62 * 1e3:.2f} ms"
            )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", choices=("engine", "allreduce"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    a = p.parse_args()
    engine(a.reps) if a.what == "engine" else allreduce(getattr(torch, a.dtype))


if __name__ == "__main__":
    main()
