"""The physical limits of this machine for the vs-vLLM offline workload
(docs/benchmarks/serving.md): measured peak GEMM FLOP/s and streaming read bandwidth, against
the model's FLOPs and bytes, as the fastest time any engine could generate the workload in.
Asserts nothing.

  python benchmarks/machine_limits.py [--threads 2] [--dtype bfloat16] [--num-prompts 16]
      [--output-len 128]

The workload is benchmarks/vs_vllm.py's offline one (prompts of 128-512 random tokens, the
same seed). Bounds, per phase:
- prefill: prompt tokens x 2 x (non-embedding parameters) FLOPs (+ causal attention's
  4 x layers x q_heads x head_dim x L^2 / 2 per prompt) at the peak GEMM rate;
- decode: each step reads every weight once (the LM head included) and every running
  sequence's KV once, at the streaming bandwidth (at these batch sizes decode is memory-bound:
  the printed arithmetic intensity says so).
Compare an engine's measured time with `bound / measured` (the fraction of the limit it
reaches).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from cpu_info import cpu_isa


def peak_gemm_flops(dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    """FLOP/s of a large square matmul (the best of `reps`)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes/s of a reduction over a buffer far larger than the caches (the best of `reps`)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def model_shape() -> dict:
    """The bundled model's shape (SmolLM2-135M-Instruct's config)."""
    from vs_vllm import _model_dir

    from engine.models.config import ModelArgs

    args = ModelArgs.from_hf_config(json.loads((Path(_model_dir()) / "config.json").read_text()))
    per_layer = (
        args.dim * (args.n_heads + 2 * args.n_kv_heads) * args.head_dim  # qkv
        + args.n_heads * args.head_dim * args.dim  # o
        + 3 * args.dim * args.intermediate_size
    )  # gate, up, down
    return {
        "layers": args.n_layers,
        "q_heads": args.n_heads,
        "kv_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "layer_params": args.n_layers * per_layer,
        "lm_head_params": args.vocab_size * args.dim,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    flops, bandwidth = peak_gemm_flops(dtype), read_bandwidth()
    m = model_shape()
    rng = random.Random(0)  # benchmarks/vs_vllm.py's prompts: the same draws, the same lengths
    lens = [
        len([rng.randrange(100, 49000) for _ in range(rng.randint(128, 512))])
        for _ in range(args.num_prompts)
    ]
    attn = sum(4 * m["layers"] * m["q_heads"] * m["head_dim"] * n * n / 2 for n in lens)
    prefill_flops = 2 * m["layer_params"] * sum(lens) + attn + 2 * m["lm_head_params"] * len(lens)
    prefill_s = prefill_flops / flops
    kv_per_token = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * size
    weights = (m["layer_params"] + m["lm_head_params"]) * size
    decode_bytes = sum(
        weights + kv_per_token * sum(n + step for n in lens) for step in range(1, args.output_len)
    )
    decode_s = decode_bytes / bandwidth
    decode_flops = 2 * (m["layer_params"] + m["lm_head_params"]) * len(lens) * (args.output_len - 1)
    tokens = args.num_prompts * args.output_len
    print(f"ISA: {cpu_isa()}, {args.threads} threads, {args.dtype}, torch {torch.__version__}")
    print(
        f"peak GEMM (2048^3): {flops / 1e12:.2f} TFLOP/s; streaming read: {bandwidth / 1e9:.1f} "
        "GB/s"
    )
    print(
        f"prefill: {sum(lens)} prompt tokens, {prefill_flops / 1e12:.2f} TFLOP -> >= "
        f"{prefill_s:.3f} s"
    )
    print(
        f"decode: {args.output_len - 1} steps of {len(lens)} sequences, {decode_bytes / 1e9:.1f} "
        f"GB read ({decode_flops / decode_bytes:.0f} FLOP/byte; the GEMM peak over bandwidth is "
        f"{flops / bandwidth:.0f}: memory-bound) -> >= {decode_s:.3f} s"
    )
    print(
        f"whole workload: >= {prefill_s + decode_s:.2f} s, i.e. <= "
        f"{tokens / (prefill_s + decode_s):.0f} "
        f"output tok/s (compare benchmarks/vs_vllm.py offline's figures)"
    )


if __name__ == "__main__":
    main()
