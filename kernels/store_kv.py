"""Write one step's new K/V into the paged KV pool, quantizing when the pool is fp8 / int8.

Pool layout (one contiguous tensor per worker, block-major, heads first inside a block):
    kv_cache[num_blocks, num_kv_heads, num_layers, 2, block_size, D_stored]   (index 0 = K, 1 = V)
D_stored is head_dim, or head_dim + 4 for an int8 pool (kernels/kv_quant.py has the formats).
A slot id is `block_id * block_size + offset_in_block`; slot -1 means "do not store" (padding).
"""

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check, check_kv_cache
from kernels.kv_quant import (
    AUTO,
    INT8,
    encode_fp8,
    format_code,
    kernel_view,
    kv_format,
    pool_head_dim,
    quantize_int8,
    quantize_kv_reference,
)


@triton.jit
def _store_rows(x, dst, mask, scale_dst, scale_mask, KV_FORMAT: tl.constexpr):
    """x [heads, dim] as the pool stores it: at dst, plus (int8) each head's scale at scale_dst."""
    if KV_FORMAT == AUTO:
        tl.store(dst, x, mask=mask)
    elif KV_FORMAT == INT8:
        q, scale = quantize_int8(x.to(tl.float32))
        tl.store(dst, q, mask=mask)
        tl.store(scale_dst, scale, mask=scale_mask)
    else:
        tl.store(dst, encode_fp8(x.to(tl.float32), KV_FORMAT), mask=mask)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    layer_offset,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    # One program per token: writes that token's K and V for every kv head.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    h = heads[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    row = cache_ptr + layer_offset + block * stride_cb + offset * stride_cs + heads * stride_ch
    dst = row[:, None] + d
    k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    # int8: the scale's 4 bytes follow the head's values (4-byte aligned: the launcher checks).
    k_scale = (row + HEAD_DIM).to(tl.pointer_type(tl.float32))
    v_scale = (row + stride_ckv + HEAD_DIM).to(tl.pointer_type(tl.float32))
    _store_rows(k, dst, mask, k_scale, heads < NUM_HEADS, KV_FORMAT)
    _store_rows(v, dst + stride_ckv, mask, v_scale, heads < NUM_HEADS, KV_FORMAT)


def _check_args(key, value, kv_cache, layer, slot_mapping) -> None:
    check_kv_cache(kv_cache, layer)
    _, num_kv_heads, _, _, _, d_stored = kv_cache.shape
    fmt, head_dim = kv_format(kv_cache), pool_head_dim(kv_cache)
    for name, x in (("key", key), ("value", value)):
        check(
            x.dim() == 3 and tuple(x.shape[1:]) == (num_kv_heads, head_dim),
            f"{name} must be [T, {num_kv_heads}, {head_dim}] to match kv_cache (format {fmt}, "
            f"last dim {d_stored}), got {tuple(x.shape)}",
        )
        if fmt == "auto":
            check(
                x.dtype == kv_cache.dtype,
                f"{name} dtype {x.dtype} != kv_cache dtype {kv_cache.dtype}",
            )
        else:
            check(x.dtype in FLOAT_DTYPES, f"{name} dtype {x.dtype} not in {FLOAT_DTYPES}")
        check(
            x.device == kv_cache.device, f"{name} is on {x.device}, kv_cache on {kv_cache.device}"
        )
        check(x.stride(2) == 1, f"{name} must have a contiguous last dim, strides {x.stride()}")
    check(key.dtype == value.dtype, f"key dtype {key.dtype} != value dtype {value.dtype}")
    check(key.shape[0] == value.shape[0], f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    check(
        slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0],
        f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}",
    )
    check(
        slot_mapping.dtype in (torch.int32, torch.int64),
        f"slot_mapping must be int32/int64, got {slot_mapping.dtype}",
    )
    check(
        slot_mapping.device == kv_cache.device,
        f"slot_mapping is on {slot_mapping.device}, kv_cache on {kv_cache.device}",
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [T, num_kv_heads, head_dim] of layer `layer` at their slots (in place),
    encoded in the pool's format (from its dtype: model dtype, fp8 e4m3/e5m2, or int8 with
    D_stored = head_dim + 4; kernels/kv_quant.py). key/value are in the model dtype.

    Slots < 0 are skipped. Slots must be distinct (apart from -1) and inside the pool; they are
    not range-checked here (that would need a device sync)."""
    _check_args(key, value, kv_cache, layer, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, num_kv_heads, _, _, block_size, _ = kv_cache.shape
    head_dim = key.shape[2]
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kernel_view(kv_cache),
        slot_mapping,
        layer * kv_cache.stride(2),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(3),
        kv_cache.stride(4),
        kv_cache.stride(1),
        BLOCK_SIZE=block_size,
        NUM_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        KV_FORMAT=format_code(kv_cache),
    )


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch `store_kv` (same contract; the encoding is `quantize_kv_reference`)."""
    _check_args(key, value, kv_cache, layer, slot_mapping)
    block_size = kv_cache.shape[4]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indices split by the heads' slice: the result is [T, num_kv_heads, D_stored].
    kv_cache[blocks, :, layer, 0, offsets] = quantize_kv_reference(key[keep], kv_cache.dtype)
    kv_cache[blocks, :, layer, 1, offsets] = quantize_kv_reference(value[keep], kv_cache.dtype)
