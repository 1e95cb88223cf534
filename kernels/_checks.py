"""Argument checks shared by the kernel launchers: fail early, with the offending shape in the
message, instead of letting a kernel read out of bounds."""

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The model dtypes ("auto") and the quantized formats of kernels/kv_quant.py.
KV_POOL_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_kv_cache(kv_cache: torch.Tensor, layer: int) -> None:
    """kv_cache must be the pool: [num_blocks, num_kv_heads, num_layers, 2, block_size, D_stored],
    contiguous (one block = one contiguous region, one head of a block too), in one of the
    formats of kernels/kv_quant.py."""
    check(
        kv_cache.dim() == 6 and kv_cache.shape[3] == 2,
        "kv_cache must be [num_blocks, num_kv_heads, num_layers, 2, block_size, D_stored], "
        f"got {tuple(kv_cache.shape)}",
    )
    check(kv_cache.is_contiguous(), f"kv_cache must be contiguous, strides {kv_cache.stride()}")
    check(
        kv_cache.dtype in KV_POOL_DTYPES, f"kv_cache dtype {kv_cache.dtype} not in {KV_POOL_DTYPES}"
    )
    check(0 <= layer < kv_cache.shape[2], f"layer {layer} out of range [0, {kv_cache.shape[2]})")


def check_token_slots(token_slots: torch.Tensor, num_tokens: int, device: torch.device) -> None:
    """token_slots must be [T] int32/int64 on `device`: one adapter slot per token, -1 = none."""
    check(
        token_slots.dim() == 1 and token_slots.shape[0] == num_tokens,
        f"token_slots must be [T={num_tokens}], got {tuple(token_slots.shape)}",
    )
    check(
        token_slots.stride(0) == 1 or num_tokens <= 1,
        f"token_slots must be contiguous, strides {token_slots.stride()}",
    )
    check(
        token_slots.dtype in (torch.int32, torch.int64),
        f"token_slots must be int32/int64, got {token_slots.dtype}",
    )
    check(
        token_slots.device == device, f"token_slots is on {token_slots.device}, expected {device}"
    )
