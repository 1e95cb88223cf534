"""Second half of batched multi-LoRA (Punica BGMV): add each token's adapter delta to the
base projection's output, in place.

    y[t] += scale[s] * (b_stack[s] @ shrunk[t])       for s = token_slots[t] >= 0
y [T, H_out] is the base output (model dtype), shrunk [T, R] fp32 from `lora_shrink`, b_stack
[S, H_out, R] the LoRA B matrices (rank padded to R with zero columns), scale [S] fp32 the per-slot
lora_alpha / r. Rows with slot -1 are not touched. The delta is fp32 and added to y in fp32;
the sum is rounded once to y's dtype.

Fused projections: y and shrunk may be column views. For a fused qkv output with one B stack per
projection, call once per projection on `qkv[:, off:off + H_out]` (and the matching
`shrunk[:, i * R:(i + 1) * R]` when the A stacks were shrunk together).
"""

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check, check_token_slots
from kernels.lora_shrink import MAX_RANK, TILE_ELEMENTS  # B tile is BLOCK_N x BLOCK_R

MAX_BLOCK_N = 128


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    shrunk_ptr,
    b_ptr,
    slots_ptr,
    scale_ptr,
    width,
    rank,
    stride_yt,
    stride_st,
    stride_bs,
    stride_bn,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # One program per (token, BLOCK_N output columns): the whole rank fits in one tile.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    s = tl.load(shrunk_ptr + t * stride_st + r, mask=r < rank, other=0.0)
    b = tl.load(
        b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :],
        mask=(n[:, None] < width) & (r[None, :] < rank),
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * s[None, :], axis=1) * tl.load(scale_ptr + slot)
    y_row = y_ptr + t * stride_yt + n
    y = tl.load(y_row, mask=n < width, other=0.0)
    tl.store(y_row, (y.to(tl.float32) + delta).to(y.dtype), mask=n < width)


def _check_args(y, shrunk, b_stack, token_slots, scale) -> None:
    check(y.dim() == 2, f"y must be [T, H_out], got {tuple(y.shape)}")
    check(y.dtype in FLOAT_DTYPES, f"y dtype {y.dtype} not in {FLOAT_DTYPES}")
    check(
        y.stride(1) == 1 or y.shape[1] <= 1,
        f"y must have a contiguous last dim, strides {y.stride()}",
    )
    num_tokens, width = y.shape
    check(
        b_stack.dim() == 3 and b_stack.shape[1] == width,
        f"b_stack must be [S, H_out={width}, R], got {tuple(b_stack.shape)}",
    )
    num_slots, _, rank = b_stack.shape
    check(0 < rank <= MAX_RANK, f"b_stack rank {rank} not in [1, {MAX_RANK}]")
    check(b_stack.dtype == y.dtype, f"b_stack dtype {b_stack.dtype} != y dtype {y.dtype}")
    check(b_stack.device == y.device, f"b_stack is on {b_stack.device}, y on {y.device}")
    check(
        b_stack.stride(2) == 1 or rank <= 1,
        f"b_stack must have a contiguous last dim, strides {b_stack.stride()}",
    )
    check(
        shrunk.shape == (num_tokens, rank),
        f"shrunk must be [T={num_tokens}, R={rank}], got {tuple(shrunk.shape)}",
    )
    check(shrunk.dtype == torch.float32, f"shrunk must be float32, got {shrunk.dtype}")
    check(shrunk.device == y.device, f"shrunk is on {shrunk.device}, y on {y.device}")
    check(
        shrunk.stride(1) == 1 or rank <= 1,
        f"shrunk must have a contiguous last dim, strides {shrunk.stride()}",
    )
    check(
        scale.shape == (num_slots,) and scale.dtype == torch.float32,
        f"scale must be [S={num_slots}] float32, got {tuple(scale.shape)} {scale.dtype}",
    )
    check(scale.device == y.device, f"scale is on {scale.device}, y on {y.device}")
    check(
        scale.stride(0) == 1 or num_slots <= 1,
        f"scale must be contiguous, strides {scale.stride()}",
    )
    check_token_slots(token_slots, num_tokens, y.device)


def lora_expand(
    y: torch.Tensor,
    shrunk: torch.Tensor,
    b_stack: torch.Tensor,
    token_slots: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """y[t] += scale[s] * (b_stack[s] @ shrunk[t]) for s = token_slots[t] >= 0, in place.

    y [T, H_out] and b_stack [S, H_out, R] share a float dtype; shrunk [T, R] and scale [S] are
    fp32. y, shrunk and b_stack may be strided views with a contiguous last dim (a column slice
    of a fused qkv / gate-up output is a valid y). Slots are not range-checked (that would need a
    device sync)."""
    _check_args(y, shrunk, b_stack, token_slots, scale)
    num_tokens, width = y.shape
    if num_tokens == 0 or width == 0:
        return
    rank = b_stack.shape[2]
    block_r = triton.next_power_of_2(rank)
    block_n = min(triton.next_power_of_2(width), MAX_BLOCK_N, max(16, TILE_ELEMENTS // block_r))
    _lora_expand_kernel[(num_tokens, triton.cdiv(width, block_n))](
        y,
        shrunk,
        b_stack,
        token_slots,
        scale,
        width,
        rank,
        y.stride(0),
        shrunk.stride(0),
        b_stack.stride(0),
        b_stack.stride(1),
        BLOCK_N=block_n,
        BLOCK_R=block_r,
    )


def lora_expand_reference(
    y: torch.Tensor,
    shrunk: torch.Tensor,
    b_stack: torch.Tensor,
    token_slots: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """Plain-torch `lora_expand` (same contract): one dense matmul per slot, each token keeps
    the row of its own slot. No device sync, no [T, H_out, R] gather."""
    _check_args(y, shrunk, b_stack, token_slots, scale)
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    for slot in range(b_stack.shape[0]):
        delta = torch.where(
            (token_slots == slot)[:, None], scale[slot] * (shrunk @ b_stack[slot].float().T), delta
        )
    y.copy_(torch.where((token_slots >= 0)[:, None], (y.float() + delta).to(y.dtype), y))
