"""Quantized KV cache (vLLM's kv_cache_dtype) benchmark: what each KV format buys and costs,
ratios against `auto` measured in the same run. Prints numbers; asserts nothing.

    python benchmarks/kv_dtype_bench.py            # ~5 minutes on 2 vCPUs
    python benchmarks/kv_dtype_bench.py --quick    # fewer reps, shorter decode

Formats: auto in bfloat16 and in float32 (the model dtype, unchanged), fp8_e4m3, fp8_e5m2 and
int8 (per-token, per-head float32 scales inside the block: head_dim + 4 bytes per row).

- capacity: at a fixed KV memory (--kv-memory, 1 GiB), the engine's own pool sizing
  (engine/kv/kv_pool.py) for the default model: blocks, and how many --context-token sequences
  fit at once (their blocks only).
- transfer: KV bytes of one --context-token request (its blocks) and the time to move them
  between two processes on this host over NIXL (benchmarks/kv_transfer.py's sender/receiver:
  8 batches, the last with the notification; time from the first send to the receiver's
  poll reporting COMPLETE), pools of each format on transparent huge pages; best and median
  of --transfer-reps.
- throughput: decode tok/s of a batch (--batch sequences of --prompt-len prompt tokens,
  --steps decode steps, prefill excluded), full model, each format over the bf16 model (and
  auto fp32), interleaved over --reps, best taken.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from typing import Any

GiB = 1 << 30
#: (label, kv_cache_dtype, model dtype): auto in both model dtypes, then every quantized format
#: over the bf16 model (their pool does not depend on the model dtype; their compute does).
FORMATS = [
    ("auto bf16", "auto", "bfloat16"),
    ("auto fp32", "auto", "float32"),
    ("fp8_e4m3", "fp8_e4m3", "bfloat16"),
    ("fp8_e5m2", "fp8_e5m2", "bfloat16"),
    ("int8", "int8", "bfloat16"),
]


def capacity(kv_memory: int, context: int, block_size: int) -> list[dict[str, Any]]:
    import json

    import torch

    from engine.config import EngineConfig
    from engine.kv.kv_pool import kv_block_bytes, num_blocks_for_budget
    from engine.models.config import ModelArgs
    from engine.models.prepare import default_model_dir

    args = ModelArgs.from_hf_config(json.loads((default_model_dir() / "config.json").read_text()))
    rows = []
    for label, kv, dtype in FORMATS:
        config = EngineConfig(kv_cache_memory=kv_memory, kv_cache_dtype=kv, block_size=block_size)
        model_dtype = getattr(torch, dtype)
        blocks = num_blocks_for_budget(config, args, model_dtype, torch.device("cpu"), None)
        per_seq = math.ceil(context / block_size)
        rows.append(
            dict(
                format=label,
                block_bytes=kv_block_bytes(args, block_size, model_dtype, kv),
                blocks=blocks,
                max_seqs=blocks // per_seq,
                request_bytes=per_seq * kv_block_bytes(args, block_size, model_dtype, kv),
            )
        )
    return rows


def transfer(context: int, block_size: int, reps: int) -> dict[str, tuple[float, float]]:
    """label -> (best, median) seconds to move one request's blocks between two processes."""
    import torch
    from kv_transfer import Bench, _backend, _digest, _pool

    per_seq = math.ceil(context / block_size)
    num_blocks = per_seq + per_seq // 4
    rng = torch.Generator().manual_seed(0)
    bench = Bench("cpu")
    out: dict[str, list[float]] = {}
    try:
        for label, kv, dtype in FORMATS:
            meta = bench.call("setup", num_blocks, block_size, kv, dtype)
            src = _pool(num_blocks, block_size, "cpu", 1.0, kv, dtype)
            src.view(torch.uint8).copy_(
                torch.randint(0, 256, src.view(torch.uint8).shape, dtype=torch.uint8, generator=rng)
            )
            backend = _backend(f"bench-send-{label.replace(' ', '-')}", src, kv)
            peer = backend.add_peer(meta)
            bench.transfer(backend, peer, [0], [0], 1)  # warm: first write after wire-up
            local = torch.randperm(num_blocks, generator=rng)[:per_seq].tolist()
            remote = torch.randperm(num_blocks, generator=rng)[:per_seq].tolist()
            times = [bench.transfer(backend, peer, local, remote, 8)[0] for _ in range(reps)]
            assert bench.call("checksum", remote[-1]) == _digest(src[local[-1]]), "bytes differ"
            out[label] = times
            backend.close()
    finally:
        bench.close()
    return {k: (min(v), statistics.median(v)) for k, v in out.items()}


def decode_tok_s(llm: Any, prompts: list, steps: int, loras: list | None = None) -> float:
    """Tokens per second of the decode steps after every row has its first token (prefill
    excluded). `loras`: a LoRARequest (or None) per prompt. Shared by benchmarks/lora_bench.py."""
    from engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(
            f"r{time.monotonic_ns()}-{i}", p, params, lora_request=loras[i] if loras else None
        )
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    tokens, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(d.token_ids) for d in engine.step())
    return tokens / (time.perf_counter() - t0)


def throughput(batch: int, prompt_len: int, steps: int, reps: int) -> dict[str, list[float]]:
    from engine import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(prompt_len)] for _ in range(batch)]
    llms = {
        label: LLM(dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=GiB // 4)
        for label, kv, dtype in FORMATS
    }
    for llm in llms.values():
        decode_tok_s(llm, prompts[:2], 2)  # warm-up
    out: dict[str, list[float]] = {label: [] for label in llms}
    for _ in range(reps):  # interleaved: every format sees the same machine load
        for label, llm in llms.items():
            out[label].append(decode_tok_s(llm, prompts, steps))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kv-memory", type=int, default=GiB)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--transfer-reps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.transfer_reps, args.steps, args.reps, args.prompt_len = 3, 12, 1, 128
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch allocates (kv_transfer.py)
    import torch

    torch.set_num_threads(args.threads)
    base = "auto bf16"

    print(f"## capacity at {args.kv_memory / GiB:g} GiB of KV, {args.context}-token sequences")
    cap = capacity(args.kv_memory, args.context, args.block_size)
    ref = next(r for r in cap if r["format"] == base)
    print("| format | block bytes | blocks | max concurrent seqs | vs auto bf16 |")
    for r in cap:
        print(
            f"| {r['format']} | {r['block_bytes']:,} | {r['blocks']:,} | {r['max_seqs']} | "
            f"{r['max_seqs'] / ref['max_seqs']:.2f}x |"
        )

    print(
        f"\n## one {args.context}-token request over NIXL, two processes (best / median of "
        f"{args.transfer_reps})"
    )
    moved = transfer(args.context, args.block_size, args.transfer_reps)
    print("| format | KV bytes | transfer ms | GB/s | time vs auto bf16 |")
    for r in cap:
        best, med = moved[r["format"]]
        print(
            f"| {r['format']} | {r['request_bytes']:,} | {1e3 * best:.2f} ({1e3 * med:.2f}) | "
            f"{r['request_bytes'] / best / 1e9:.2f} | {best / moved[base][0]:.2f}x |"
        )

    print(
        f"\n## decode throughput: batch {args.batch}, {args.prompt_len}-token prompts, "
        f"{args.steps} steps, {args.threads} thread(s), full model, best of {args.reps}"
    )
    tps = throughput(args.batch, args.prompt_len, args.steps, args.reps)
    print("| format | tok/s | vs auto bf16 | reps |")
    for label, values in tps.items():
        print(
            f"| {label} | {max(values):.1f} | {max(values) / max(tps[base]):.2f}x | "
            f"{', '.join(f'{v:.1f}' for v in values)} |"
        )


if __name__ == "__main__":
    main()
