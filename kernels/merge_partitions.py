"""Second stage of split-KV (flash-decoding) attention: combine the per-partition partial
results written by `paged_attention_kernel` into the final output.

Partial buffers, fp32 and contiguous, for T tokens, H query heads, P partitions:
    part_acc [T, H, P, head_dim]  sum_j exp2(s_j - m_p) * v_j over the partition's keys
    part_max [T, H, P]            m_p, running max of the base-2 scores (EMPTY_MAX if no key)
    part_sum [T, H, P]            l_p = sum_j exp2(s_j - m_p)  (0 if no key)
out = sum_p acc_p * 2^(m_p - M) / sum_p l_p * 2^(m_p - M),  M = max_p m_p.
Some partition holds the query's own key, which it always sees, so the denominator is positive
(partitions without a visible key have weight 2^(EMPTY_MAX - M) = 0).
"""

import torch
import triton
import triton.language as tl

from kernels._checks import check


@triton.jit
def merge_partitions_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_q_heads,
    num_partitions,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PART_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p = tl.arange(0, PART_PAD)
    p_ok = p < num_partitions
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    stat = (token * num_q_heads + head) * num_partitions + p
    m = tl.load(part_max_ptr + stat, mask=p_ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + stat, mask=p_ok, other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))
    acc = tl.load(
        part_acc_ptr + stat[:, None] * HEAD_DIM + d[None, :],
        mask=p_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(sums * weight, 0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def merge_partitions(
    out: torch.Tensor, part_acc: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor
) -> None:
    """Write into out [T, H, head_dim] the merge of the partial buffers (see module doc)."""
    num_tokens, num_heads, head_dim = out.shape
    num_partitions = part_max.shape[2]
    check(
        tuple(part_acc.shape) == (num_tokens, num_heads, num_partitions, head_dim)
        and tuple(part_max.shape)
        == tuple(part_sum.shape)
        == (num_tokens, num_heads, num_partitions),
        f"partial buffers {tuple(part_acc.shape)}, {tuple(part_max.shape)}, "
        f"{tuple(part_sum.shape)} do not match out {tuple(out.shape)}",
    )
    for name, x in (("part_acc", part_acc), ("part_max", part_max), ("part_sum", part_sum)):
        check(x.dtype == torch.float32 and x.is_contiguous(), f"{name} must be contiguous fp32")
    check(out.stride(2) == 1, f"out must have a contiguous last dim, strides {out.stride()}")
    if num_tokens == 0:
        return
    merge_partitions_kernel[(num_tokens, num_heads)](
        out,
        part_acc,
        part_max,
        part_sum,
        num_heads,
        num_partitions,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        PART_PAD=triton.next_power_of_2(num_partitions),
    )
