"""Mixture-of-experts layer on the CPU (engine/models/moe.py's torch path). Prints ratios;
asserts nothing.

    python benchmarks/moe_step.py                  # both presets, bf16 and fp32, ~2 minutes
    python benchmarks/moe_step.py --preset qwen3 --dtype bfloat16 --threads 2

For T in --tokens, one layer forward (router included) of:
- grouped: SparseMoE's path — assignments sorted by expert, one matmul pair per expert with
  tokens, one index_add_ — against hf-loop: transformers' eager experts (a one-hot mask,
  `torch.where` per hit expert, index_add_ per expert), same weights and routing;
- dense: a SwiGLU MLP with the same ACTIVE parameters per token (I_dense = top_k * I_moe),
  i.e. the same FLOPs: what the MoE's grouping costs over one big GEMM pair;
- sync: the `bincount(...).tolist()` the grouped path reads per layer, alone.
Times are the best of --reps rounds after a warm-up (the first three interleaved round by
round; sync alone, 200 reps), at --threads torch threads.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine.models.interface import ForwardContext
from engine.models.moe import SparseMoE, route

#: name -> (dim, experts, top_k, moe_intermediate): per-layer shapes scaled down from the real
#: models so that both fit a small CPU (Qwen3-30B-A3B: 2048/128/8/768; Mixtral-8x7B:
#: 4096/8/2/14336).
PRESETS = {"qwen3": (1024, 64, 8, 384), "mixtral": (1024, 8, 2, 1792)}


def hf_loop_experts(x, w13, w2, weights, ids):
    """transformers 5.24 MixtralExperts.forward (eager), on our stacked weights."""
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    mask = F.one_hot(ids, num_classes=num_experts + 1).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        if e == num_experts:
            continue
        k, t = torch.where(mask[e])
        gate, up = F.linear(x[t], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights[t, k, None]
        out.index_add_(0, t, y.to(out.dtype))
    return out


def best_times(fns: dict, reps: int, budget_s: float = 6.0) -> dict[str, float]:
    """Best time of each fn, the fns interleaved round by round (a busy machine's drift hits
    them alike), after one warm-up each; stops early past `budget_s`."""
    for fn in fns.values():
        fn()
    best, spent = dict.fromkeys(fns, float("inf")), 0.0
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            best[name], spent = min(best[name], elapsed), spent + elapsed
        if spent > budget_s:
            break
    return best


def run(preset: str, dtype: torch.dtype, tokens: list[int], reps: int) -> None:
    dim, experts, top_k, inter = PRESETS[preset]
    gen = torch.Generator().manual_seed(0)
    moe = SparseMoE(dim, experts, top_k, inter, renormalize=True, layer=0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    moe = moe.to(dtype)
    dense_inter = top_k * inter
    gate_up = (torch.randn(2 * dense_inter, dim, generator=gen) / dim**0.5).to(dtype)
    down = (torch.randn(dim, dense_inter, generator=gen) / dense_inter**0.5).to(dtype)
    ctx = ForwardContext(None, None, None)

    def dense(x):
        g, u = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, down)

    def hf_layer(x):
        weights, ids = route(moe.gate(x), top_k, True, None)
        return hf_loop_experts(x, moe.w13, moe.w2, weights, ids)

    print(
        f"\n{preset}: dim {dim}, {experts} experts, top_k {top_k}, moe_intermediate {inter} "
        f"(dense equivalent: intermediate {dense_inter}), {str(dtype).removeprefix('torch.')}"
    )
    print(
        f"{'T':>5} {'grouped ms':>11} {'hf-loop ms':>11} {'hf/grouped':>11} {'dense ms':>9} "
        f"{'moe/dense':>10} {'sync us':>8} {'experts hit':>12}"
    )
    with torch.no_grad():
        for num_tokens in tokens:
            x = torch.randn(num_tokens, dim, generator=gen).to(dtype)
            torch.testing.assert_close(
                moe(x, ctx).float(), hf_layer(x).float(), atol=5e-2, rtol=5e-2
            )
            ids = route(moe.gate(x), top_k, True, None)[1].reshape(-1)
            t = best_times(
                {
                    "grouped": lambda: moe(x, ctx),
                    "hf": lambda: hf_layer(x),
                    "dense": lambda: dense(x),
                },
                reps,
            )
            t_grouped, t_hf, t_dense = t["grouped"], t["hf"], t["dense"]
            read_counts = lambda: torch.bincount(ids, minlength=experts).tolist()  # noqa: E731
            t_sync = best_times({"sync": read_counts}, 200)["sync"]
            print(
                f"{num_tokens:>5} {t_grouped * 1e3:>11.3f} {t_hf * 1e3:>11.3f} "
                f"{t_hf / t_grouped:>10.2f}x "
                f"{t_dense * 1e3:>9.3f} {t_grouped / t_dense:>9.2f}x {t_sync * 1e6:>8.1f} "
                f"{len(ids.unique()):>12}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=[*PRESETS, "all"], default="all")
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "all"], default="all")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    for preset in PRESETS if args.preset == "all" else [args.preset]:
        for dtype in ["bfloat16", "float32"] if args.dtype == "all" else [args.dtype]:
            run(preset, getattr(torch, dtype), args.tokens, args.reps)


if __name__ == "__main__":
    main()
