"""Argument checks shared by the kernel launchers: fail early, with the offending shape in the
message, instead of letting a kernel read out of bounds."""
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_kv_cache(kv_cache: torch.Tensor, layer: int) -> None:
    """kv_cache must be the pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim],
    contiguous (one block = one contiguous region)."""
    check(kv_cache.dim() == 6 and kv_cache.shape[2] == 2,
          "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
          f"got {tuple(kv_cache.shape)}")
    check(kv_cache.is_contiguous(), f"kv_cache must be contiguous, strides {kv_cache.stride()}")
    check(kv_cache.dtype in FLOAT_DTYPES, f"kv_cache dtype {kv_cache.dtype} not in {FLOAT_DTYPES}")
    check(0 <= layer < kv_cache.shape[1], f"layer {layer} out of range [0, {kv_cache.shape[1]})")
