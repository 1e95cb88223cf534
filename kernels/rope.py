"""Rotary position embedding applied in place to q and k, HF LLaMA "rotate_half" convention
(non-interleaved): with x1 = x[:half], x2 = x[half:2*half] and angle f_i * pos,
    x1' = x1 * cos - x2 * sin,    x2' = x2 * cos + x1 * sin.
cos_sin_cache [max_position, rotary_dim] holds cos(pos * f_i) in its first rotary_dim / 2
columns and sin in the rest (`rope_cos_sin_cache` builds it); dims past rotary_dim are left
as they are. Math is fp32, results are rounded once to q/k's dtype.
"""

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, token, num_heads, cos, sin, h, i, HALF: tl.constexpr):
    mask = (h < num_heads)[:, None] & (i < HALF)[None, :]
    ptr = x_ptr + token * stride_t + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    y1 = x1.to(tl.float32) * cos[None, :] - x2.to(tl.float32) * sin[None, :]
    y2 = x2.to(tl.float32) * cos[None, :] + x1.to(tl.float32) * sin[None, :]
    tl.store(ptr, y1.to(x1.dtype), mask=mask)
    tl.store(ptr + HALF, y2.to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
):
    # One program per token: every q and k head of that token.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=i < HALF, other=0.0).to(
        tl.float32
    )
    _rotate(
        q_ptr,
        stride_qt,
        stride_qh,
        token,
        NUM_Q_HEADS,
        cos,
        sin,
        tl.arange(0, Q_HEADS_PAD),
        i,
        HALF,
    )
    _rotate(
        k_ptr,
        stride_kt,
        stride_kh,
        token,
        NUM_K_HEADS,
        cos,
        sin,
        tl.arange(0, K_HEADS_PAD),
        i,
        HALF,
    )


def _check_args(q, k, positions, cos_sin_cache) -> None:
    check(
        cos_sin_cache.dim() == 2
        and cos_sin_cache.shape[1] % 2 == 0
        and cos_sin_cache.stride(1) == 1,
        f"cos_sin_cache must be [max_position, rotary_dim] (even, contiguous rows), "
        f"got {tuple(cos_sin_cache.shape)} strides {cos_sin_cache.stride()}",
    )
    rotary_dim = cos_sin_cache.shape[1]
    for name, x in (("q", q), ("k", k)):
        check(
            x.dim() == 3 and x.shape[0] == positions.shape[0] and x.shape[2] >= rotary_dim,
            f"{name} must be [T={positions.shape[0]}, heads, head_dim >= {rotary_dim}], "
            f"got {tuple(x.shape)}",
        )
        check(x.dtype in FLOAT_DTYPES, f"{name} dtype {x.dtype} not in {FLOAT_DTYPES}")
        check(x.stride(2) == 1, f"{name} must have a contiguous last dim, strides {x.stride()}")
        check(
            x.device == positions.device == cos_sin_cache.device,
            f"{name}, positions and cos_sin_cache must share a device",
        )
    check(
        positions.dim() == 1 and positions.dtype in (torch.int32, torch.int64),
        f"positions must be [T] int32/int64, got {tuple(positions.shape)} {positions.dtype}",
    )


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate q [T, num_q_heads, head_dim] and k [T, num_kv_heads, head_dim] in place.
    q/k may be strided views (e.g. of a fused qkv output); positions [T] index the cache
    (not range-checked: that needs a sync)."""
    _check_args(q, k, positions, cos_sin_cache)
    if q.shape[0] == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    _rope_kernel[(q.shape[0],)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=q.shape[1],
        NUM_K_HEADS=k.shape[1],
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]),
        K_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
    )


def apply_rope_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Plain-torch `apply_rope` (same contract, in place)."""
    _check_args(q, k, positions, cos_sin_cache)
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions.long()].float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x[..., : 2 * half] = rotated.to(x.dtype)


def rope_cos_sin_cache(
    rotary_dim: int, max_position: int, theta: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """[max_position, rotary_dim] fp32: cos(pos * f_i) | sin(pos * f_i),
    f_i = theta^(-2i/rotary_dim) (plain RoPE, no rope_scaling)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    )
    angles = (
        torch.arange(max_position, dtype=torch.int64, device=device).float()[:, None]
        * inv_freq[None, :]
    )
    return torch.cat((angles.cos(), angles.sin()), dim=-1)
