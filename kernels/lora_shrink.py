"""First half of batched multi-LoRA (Punica BGMV): each token's input times its own adapter's A.

    shrunk[t] = a_stack[token_slots[t]] @ x[t]        (zeros where token_slots[t] == -1)
x [T, H_in] is the projection's input, a_stack [S, R, H_in] the LoRA A matrices of S adapter slots
(rank padded to R with zero rows), token_slots [T] the slot of each token's adapter. The result
[T, R] is fp32 and feeds `lora_expand`. Products and sums are fp32.

Projections that share an input (q/k/v, gate/up) can stack their A matrices along R
(a_stack [S, 3R, H_in]) and shrink once; each projection's expand then reads a column view of
the result.
"""

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check, check_token_slots

MAX_RANK = 256
TILE_ELEMENTS = 4096  # A tile is BLOCK_R x BLOCK_K


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    out_ptr,
    hidden,
    rank,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ot,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # One program per (token, K split). Split k walks input chunks k, k + SPLIT_K, ...; with
    # SPLIT_K > 1 the partial sums are atomically added into a zeroed `out`.
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    out = out_ptr + t * stride_ot + r
    if slot < 0:
        if SPLIT_K == 1:
            tl.store(out, tl.zeros((BLOCK_R,), dtype=tl.float32), mask=r < rank)
        return
    a_rows = a_ptr + slot * stride_as + r[:, None] * stride_ar
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(split * BLOCK_K, hidden, SPLIT_K * BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_xt + k, mask=k < hidden, other=0.0).to(tl.float32)
        a = tl.load(
            a_rows + k[None, :], mask=(r[:, None] < rank) & (k[None, :] < hidden), other=0.0
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    if SPLIT_K == 1:
        tl.store(out, acc, mask=r < rank)
    else:
        tl.atomic_add(out, acc, mask=r < rank)


def _check_args(x, a_stack, token_slots, out) -> None:
    check(x.dim() == 2, f"x must be [T, H_in], got {tuple(x.shape)}")
    check(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} not in {FLOAT_DTYPES}")
    check(
        x.stride(1) == 1 or x.shape[1] <= 1,
        f"x must have a contiguous last dim, strides {x.stride()}",
    )
    num_tokens, hidden = x.shape
    check(
        a_stack.dim() == 3 and a_stack.shape[2] == hidden,
        f"a_stack must be [S, R, H_in={hidden}], got {tuple(a_stack.shape)}",
    )
    check(
        0 < a_stack.shape[1] <= MAX_RANK, f"a_stack rank {a_stack.shape[1]} not in [1, {MAX_RANK}]"
    )
    check(a_stack.dtype == x.dtype, f"a_stack dtype {a_stack.dtype} != x dtype {x.dtype}")
    check(a_stack.device == x.device, f"a_stack is on {a_stack.device}, x on {x.device}")
    check(
        a_stack.stride(2) == 1 or hidden <= 1,
        f"a_stack must have a contiguous last dim, strides {a_stack.stride()}",
    )
    check_token_slots(token_slots, num_tokens, x.device)
    if out is not None:
        rank = a_stack.shape[1]
        check(
            out.shape == (num_tokens, rank),
            f"out must be [T={num_tokens}, R={rank}], got {tuple(out.shape)}",
        )
        check(out.dtype == torch.float32, f"out must be float32, got {out.dtype}")
        check(out.device == x.device, f"out is on {out.device}, x on {x.device}")
        check(
            out.stride(1) == 1 or rank <= 1,
            f"out must have a contiguous last dim, strides {out.stride()}",
        )


def lora_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    split_k: int = 1,
) -> torch.Tensor:
    """shrunk [T, R] fp32 with shrunk[t] = a_stack[token_slots[t]] @ x[t], zeros for slot -1.

    x [T, H_in] and a_stack [S, R, H_in] share a float dtype; both may be row-strided views
    (last dim contiguous). Slots are not range-checked (that would need a device sync). `out`
    ([T, R] fp32) is written and returned if given. `split_k` > 1 splits the input dim over that
    many programs per token (for small decode batches on GPU); they add into `out` with fp32
    atomics, so the summation order, and the last bits, may vary from run to run."""
    _check_args(x, a_stack, token_slots, out)
    check(split_k >= 1, f"split_k must be >= 1, got {split_k}")
    num_tokens, hidden = x.shape
    rank = a_stack.shape[1]
    if out is None:
        out = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    if hidden == 0:
        return out.zero_()
    block_r = triton.next_power_of_2(rank)
    block_k = min(triton.next_power_of_2(hidden), max(16, TILE_ELEMENTS // block_r))
    split_k = min(split_k, triton.cdiv(hidden, block_k))
    if split_k > 1:
        out.zero_()
    _lora_shrink_kernel[(num_tokens, split_k)](
        x,
        a_stack,
        token_slots,
        out,
        hidden,
        rank,
        x.stride(0),
        a_stack.stride(0),
        a_stack.stride(1),
        out.stride(0),
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
    )
    return out


def lora_shrink_reference(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch `lora_shrink` (same contract): one dense matmul per slot, each token keeps
    the row of its own slot. No device sync, no [T, R, H_in] gather."""
    _check_args(x, a_stack, token_slots, out)
    xf = x.float()
    shrunk = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for slot in range(a_stack.shape[0]):
        shrunk = torch.where((token_slots == slot)[:, None], xf @ a_stack[slot].float().T, shrunk)
    if out is None:
        return shrunk
    out.copy_(shrunk)
    return out
