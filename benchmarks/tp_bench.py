"""Tensor parallelism on the CPU (docs/parallelism.md). Prints numbers; asserts nothing.

    python -m benchmarks.tp_bench engine      # TP=2 (1 thread/rank) vs TP=1 (2 threads), ~2 min
    python -m benchmarks.tp_bench allreduce   # gloo all-reduce cost per call, 2 processes

engine: the default model (bf16 where the CPU has native bf16), prefill throughput (4 prompts
of 512 random tokens, one output token each) and decode throughput (8 sequences, 64 tokens
each, ignore_eos; the prefill's time measured alone and subtracted), best of --reps; the
collectives per decode step from rank 0's communicator.
allreduce: one all-reduce of [rows, 576] (the default model's width) in the model dtype, 2
ranks over gloo on loopback, median of 200 after a warm-up.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks.cpu_info import cpu_isa


def _engine_numbers(tp: int, reps: int) -> dict[str, float]:
    from engine import LLM, SamplingParams

    torch.set_num_threads(2)
    llm = LLM(tensor_parallel_size=tp, kv_cache_memory=256 << 20, max_num_batched_tokens=2048)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, 512).tolist() for _ in range(4)]
    short = [rng.integers(100, 40000, 16).tolist() for _ in range(8)]
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    many = SamplingParams(max_tokens=64, ignore_eos=True)

    def timed(ps, params) -> float:
        llm.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate(ps, params, use_tqdm=False)
        return time.perf_counter() - t

    timed(short, one)  # warm-up
    prefill = min(timed(prompts, one) for _ in range(reps))
    short_prefill = min(timed(short, one) for _ in range(reps))
    decode = min(timed(short, many) for _ in range(reps)) - short_prefill
    out = {"prefill_tok_s": 4 * 512 / prefill, "decode_tok_s": 8 * 63 / decode}
    group = llm.engine.parallel_group
    if group is not None:
        before = group.comm.calls
        steps = 0
        llm.engine.add_request("x", short[0], SamplingParams(max_tokens=9, ignore_eos=True))
        llm.engine.step()  # prefill
        before = group.comm.calls
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            steps += 1
        out["collectives_per_step"] = (group.comm.calls - before) / steps
    llm.close()
    return out


def engine(reps: int) -> None:
    print(cpu_isa())
    one = _engine_numbers(1, reps)
    two = _engine_numbers(2, reps)
    for key in ("prefill_tok_s", "decode_tok_s"):
        print(f"{key}: TP=1 (2 threads) {one[key]:.1f}  TP=2 (1 thread/rank) {two[key]:.1f}  "
              f"ratio {two[key] / one[key]:.2f}")
    print(f"collectives per decode step at TP=2: {two['collectives_per_step']:.0f}")


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
            print(f"all-reduce [{n}, 576] {dtype}: {out[n] * 1e6:.0f} us/call, "
                  f"x62 per step = {out[n] * 62 * 1e3:.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("engine", "allreduce"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    a = p.parse_args()
    engine(a.reps) if a.what == "engine" else allreduce(getattr(torch, a.dtype))


if __name__ == "__main__":
    main()
