"""The KV offloading tier (engine/kv/kv_tier.py, --kv-offloading-size): the time to get a
prefix's KV back by promoting its blocks from the tier vs recomputing them, measured in the
same run on the same engine; decode step time with the tier on vs off; a preempted request
swapped back in vs recomputed; gathered vs per-block copies and copies overlapped with a
forward. Prints numbers; asserts nothing.

    python benchmarks/kv_offload_bench.py                 # default model, 1024-token prefix
    python benchmarks/kv_offload_bench.py --quick         # 4 layers, 256 tokens, 2 reps

Each rep: a fresh prompt of --prefix-tokens is prefilled cold (recompute: its time to first
token), a filler as long as the pool (which holds one prompt) pushes all its blocks into the tier
(demotions), and the prompt is sent again (promote: its time to first token, which copies its
blocks back and computes only its last token). Also the copies alone: per-block demote and
promote time and bandwidth (the storage's store/load, timed in place). Median of --reps.

Then (benchmarks/kv_swap_bench.py): decode steps with the tier on vs off, a preempted
--swap-tokens request resumed by swap vs by recompute, and the copy variants.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cpu_info import cpu_isa


class Timed:
    """Wraps a TierStorage: the seconds and blocks of its stores (demote) and loads (promote)."""

    def __init__(self, storage) -> None:
        self.inner, self.num_slots = storage, storage.num_slots
        self.seconds = {"store": 0.0, "load": 0.0}
        self.calls = {"store": 0, "load": 0}  # blocks copied

    def _timed(self, op: str, slots: list[int], block_ids: list[int]) -> None:
        t = time.perf_counter()
        getattr(self.inner, f"{op}_many")(slots, block_ids)
        self.seconds[op] += time.perf_counter() - t
        self.calls[op] += len(slots)

    def store_many(self, slots: list[int], block_ids: list[int]) -> None:
        self._timed("store", slots, block_ids)

    def load_many(self, slots: list[int], block_ids: list[int]) -> None:
        self._timed("load", slots, block_ids)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-layers", type=int, default=None, help="first N layers only")
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--swap-tokens", type=int, default=2048, help="the preempted request's prompt")
    ap.add_argument("--decode-steps", type=int, default=64, help="per engine, tier on / off")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only-swap", action="store_true", help="skip promote vs recompute")
    args = ap.parse_args()
    if args.quick:
        args.num_layers, args.prefix_tokens, args.reps = args.num_layers or 4, 256, 2
    if not args.only_swap:
        promote_vs_recompute(args)
    from kv_swap_bench import swap_benchmarks

    swap_benchmarks(args)


def promote_vs_recompute(args) -> None:

    from engine import LLM, SamplingParams
    from engine.kv.kv_pool import kv_block_bytes

    bs, n = args.block_size, args.prefix_tokens
    blocks = -(-(n + 1) // bs)  # the prompt's and its output token's (what admission asks)
    probe = LLM(args.model, dtype=args.dtype, num_layers=args.num_layers, kv_cache_memory=1 << 24)
    eng = probe.engine
    block_bytes = kv_block_bytes(eng.loaded.args, bs, eng.dtype, eng.config.kv_cache_dtype)
    vocab = eng.loaded.args.vocab_size
    del probe, eng
    # A pool that holds one prompt (the next one evicts all of it), a tier that holds every
    # rep's prompt.
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_layers=args.num_layers,
        block_size=bs,
        kv_cache_memory=blocks * block_bytes,
        kv_offloading_size=(args.reps + 2) * (blocks + 2) * block_bytes,
        max_num_seqs=1,
    )
    tier = llm.engine.block_manager.pool.tier
    timed = tier.storage = Timed(tier.storage)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(prompt: list[int]) -> tuple[float, int]:
        t = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - t, out.num_cached_tokens

    def prompt_of(seed: int, length: int = n) -> list[int]:
        return [(seed * 7919 + 13 * i) % (vocab - 1000) + 500 for i in range(length)]

    ttft(prompt_of(10_000))  # warm-up (first forward)
    cold, promoted = [], []
    for rep in range(args.reps):
        prompt = prompt_of(rep)
        t_cold, cached = ttft(prompt)
        assert cached == 0
        ttft(prompt_of(1000 + rep, blocks * bs - 1))  # takes the whole pool: demotes `prompt`
        t_hot, cached = ttft(prompt)
        assert cached == (n - 1) // bs * bs, cached
        cold.append(t_cold)
        promoted.append(t_hot)
    c, p = statistics.median(cold), statistics.median(promoted)
    per = {op: timed.seconds[op] / max(1, timed.calls[op]) for op in ("store", "load")}
    print(f"CPU: {cpu_isa()}")
    print(
        f"model {args.model} layers={llm.engine.loaded.args.n_layers} dtype={llm.engine.dtype} "
        f"block_size={bs} block={block_bytes / 1024:.0f} KiB"
    )
    print(f"prefix {n} tokens = {(n - 1) // bs} blocks promoted; reps={args.reps} (median)")
    print(f"recompute TTFT {c * 1e3:8.1f} ms")
    print(f"promote   TTFT {p * 1e3:8.1f} ms   ratio recompute/promote {c / p:6.1f}x")
    for op, name in (("store", "demote"), ("load", "promote")):
        print(
            f"{name:7s} copy {per[op] * 1e6:8.1f} us/block  "
            f"{block_bytes / per[op] / 1e9 if per[op] else 0:6.2f} GB/s  ({timed.calls[op]} blocks)"
        )


if __name__ == "__main__":
    main()
