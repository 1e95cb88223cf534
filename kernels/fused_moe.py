"""Fused mixture-of-experts MLP (the grouped-GEMM scheme of vLLM's fused_moe):

    y[t] = sum_k  w[t, k] * (silu(x[t] @ G_e.T) * (x[t] @ U_e.T)) @ D_e.T,   e = ids[t, k]
x [T, D]; w13 [E, 2I, D] holds each expert's gate rows G_e then up rows U_e; w2 [E, D, I] its
down projection D_e; topk_weights/topk_ids [T, top_k] the router's choice.

The T * top_k (token, expert) assignments, numbered a = t * top_k + k, are sorted by expert
and each expert's run is padded to a multiple of BLOCK_M (`align_assignments`), so a block of
BLOCK_M rows belongs to one expert. Two launches of one grouped GEMM kernel then run every
expert at once: w13 with SiLU-and-mul fused in (two accumulators, gate and up) -> h [T*top_k, I],
and w2 with the routing weight multiplied in -> [T*top_k, D]; a torch sum over top_k ends it.
No host sync: the grid is sized by an upper bound and unused blocks exit at once.

Products and sums are fp32; h and each per-assignment output are rounded to x's dtype, as
`fused_moe_reference` (the oracle) does. UPCAST_DOT: the Triton interpreter (CPU, triton 3.7)
computes tl.dot on bf16 operands wrongly (triton-lang/triton#11584); there the bf16 operands are
upcast to fp32, exactly, before the dot. Never set on GPU.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check


class Alignment(NamedTuple):
    """Assignments grouped by expert, padded to whole blocks of `block_m` rows."""

    sorted_ids: torch.Tensor
    """[P] int32: assignment numbers t * top_k + k, expert by expert; padding holds T * top_k."""
    block_experts: torch.Tensor
    """[P // block_m] int32: the expert of each block; -1 for blocks past the last used one."""
    block_m: int


def align_assignments(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Group the assignments of `topk_ids` [T, top_k] by expert (stable: token order within an
    expert), each expert's run padded to a multiple of `block_m`. P is an upper bound fixed
    by the shapes (n + min(E, n) * (block_m - 1), rounded up), so nothing is read back."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[expert_of]
    bound = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((bound,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, bound, block_m, device=flat.device)
    experts = torch.searchsorted(ends, block_starts, right=True)
    block_experts = torch.where(experts < num_experts, experts, -1).to(torch.int32)
    return Alignment(sorted_ids, block_experts, block_m)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    n_out,
    k_in,
    num_assignments,
    stride_am,
    stride_be,
    stride_bn,
    stride_om,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program per (block of BLOCK_M assignments of one expert, BLOCK_N output columns).
    # Row r of the block is assignment a = sorted_ids[r]; it reads row a // A_ROW_DIV of A
    # (the token for w13, the assignment for w2) and writes row a of out.
    # out[a, n] = sum_k A[a // A_ROW_DIV, k] * B[e, n, k]; GATED: also the up row n + n_out,
    # then silu(gate) * up; MUL_WEIGHT: times weights[a].
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows).to(tl.int64)
    valid = ids < num_assignments
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (ids // A_ROW_DIV)[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = ks < k_in - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if UPCAST_DOT:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            up = tl.load(b_ptrs + n_out * stride_bn, mask=b_mask, other=0.0)
            if UPCAST_DOT:
                up = up.to(tl.float32)
            acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + ids[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


# Running under the Triton interpreter (TRITON_INTERPRET=1 when triton was imported).
_INTERPRETED = type(_moe_gemm_kernel).__name__ == "InterpretedFunction"


def _check_args(x, w13, w2, topk_weights, topk_ids) -> None:
    check(x.dim() == 2, f"x must be [T, D], got {tuple(x.shape)}")
    check(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} not in {FLOAT_DTYPES}")
    num_tokens, dim = x.shape
    check(
        w13.dim() == 3 and w13.shape[2] == dim and w13.shape[1] % 2 == 0,
        f"w13 must be [E, 2 * I, D={dim}], got {tuple(w13.shape)}",
    )
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    check(
        w2.shape == (num_experts, dim, inter),
        f"w2 must be [E={num_experts}, D={dim}, I={inter}], got {tuple(w2.shape)}",
    )
    check(
        w13.dtype == x.dtype and w2.dtype == x.dtype,
        f"x, w13, w2 dtypes differ: {x.dtype}, {w13.dtype}, {w2.dtype}",
    )
    check(
        topk_ids.dim() == 2 and topk_ids.shape[0] == num_tokens,
        f"topk_ids must be [T={num_tokens}, top_k], got {tuple(topk_ids.shape)}",
    )
    check(
        topk_ids.dtype in (torch.int32, torch.int64),
        f"topk_ids must be int32/int64, got {topk_ids.dtype}",
    )
    check(
        topk_weights.shape == topk_ids.shape,
        f"topk_weights {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}",
    )
    for name, t in (
        ("w13", w13),
        ("w2", w2),
        ("topk_weights", topk_weights),
        ("topk_ids", topk_ids),
    ):
        check(t.device == x.device, f"{name} is on {t.device}, x on {x.device}")
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        check(t.stride(-1) == 1, f"{name} must have a contiguous last dim, strides {t.stride()}")


def _block(size: int, cap: int) -> int:
    # Untuned defaults (vLLM's for small M are 16 x 32 x 64): no GPU measurement yet.
    return max(16, min(cap, triton.next_power_of_2(size)))  # tl.dot needs >= 16


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The MoE MLP of the module docstring; returns a new [T, D] tensor in x's dtype.
    `topk_weights` may be fp32 or x's dtype (multiplied in fp32 either way)."""
    _check_args(x, w13, w2, topk_weights, topk_ids)
    (num_tokens, dim), (num_experts, inter) = x.shape, (w13.shape[0], w13.shape[1] // 2)
    top_k = topk_ids.shape[1]
    n = num_tokens * top_k
    if n == 0:
        return torch.zeros_like(x)
    # Small batches (decode) give each expert a few rows: small blocks waste less padding.
    align = align_assignments(topk_ids, num_experts, _block(triton.cdiv(n, num_experts), 64))
    weights = topk_weights.reshape(-1).contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 as exact as torch's
    h = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((n, dim), dtype=x.dtype, device=x.device)
    num_blocks = align.block_experts.numel()
    for a, b, out, k_in, n_out, row_div, gated in (
        (x, w13, h, dim, inter, top_k, True),
        (h, w2, y, inter, dim, 1, False),
    ):
        block_n, block_k = _block(n_out, 64), _block(k_in, 32)
        _moe_gemm_kernel[(num_blocks, triton.cdiv(n_out, block_n))](
            a,
            b,
            out,
            weights,
            align.sorted_ids,
            align.block_experts,
            n_out,
            k_in,
            n,
            a.stride(0),
            b.stride(0),
            b.stride(1),
            out.stride(0),
            A_ROW_DIV=row_div,
            GATED=gated,
            MUL_WEIGHT=not gated,
            DOT_PRECISION=precision,
            UPCAST_DOT=x.dtype == torch.bfloat16 and _INTERPRETED,
            BLOCK_M=align.block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
    return y.view(num_tokens, top_k, dim).sum(dim=1)


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """fused_moe in plain torch, expert by expert: fp32 math, h and each assignment's output
    rounded to x's dtype, the top_k sum in fp32 rounded once."""
    _check_args(x, w13, w2, topk_weights, topk_ids)
    inter = w2.shape[2]
    y = torch.zeros((*topk_ids.shape, x.shape[1]), dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        t, k = (topk_ids == e).nonzero(as_tuple=True)
        gate, up = (x[t].float() @ w13[e].float().T).split([inter, inter], dim=-1)
        h = (torch.nn.functional.silu(gate) * up).to(x.dtype)
        out = (h.float() @ w2[e].float().T) * topk_weights[t, k, None].float()
        y[t, k] = out.to(x.dtype).float()
    return y.sum(dim=1).to(x.dtype)
