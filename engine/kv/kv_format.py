"""How K/V values are stored in the pool (vLLM's `kv_cache_dtype`).

- `auto`: the model's dtype, unchanged.
- `fp8_e4m3` (`fp8`), `fp8_e5m2`: one byte per value, cast (saturating at the format's
  range) with scale 1.0, as vLLM without calibration data.
- `int8`: per token and kv head, q = round(x / s) in [-127, 127] with s = max|x| / 127 over
  head_dim (at least 1e-8 / 127), and s stored as 4 float32 bytes after the head_dim values:
  the pool's last dimension is head_dim + 4. Per token rather than per block: a block fills
  one token at a time, so a block-wide scale would be fixed before its largest value is seen
  (and clip it); measured accuracy is in docs/kv_cache_dtype.md.

A block is self-describing either way (its scales live inside it), so a block is still one
contiguous region and one KV-transfer descriptor. The Triton kernels (kernels/store_kv.py,
kernels/paged_attention.py) implement the same encoding."""

from __future__ import annotations

import torch

_STORAGE = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_BYTES = 4  # int8: one float32 scale per token and kv head


def normalize(kv_cache_dtype: str) -> str:
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return _STORAGE.get(normalize(kv_cache_dtype), model_dtype)


def stored_head_dim(kv_cache_dtype: str, head_dim: int) -> int:
    return head_dim + SCALE_BYTES if normalize(kv_cache_dtype) == "int8" else head_dim


def quantize(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """[..., head_dim] values -> what the pool stores for them ([..., head_dim + 4] for int8)."""
    if storage == torch.int8:
        x32 = x.float()
        # A tensor divisor: CUDA torch divides by a Python scalar as a multiply by its
        # reciprocal (one ulp off the correctly rounded quotient the kernels compute).
        scale = x32.abs().amax(-1, keepdim=True).clamp(min=1e-8) / x32.new_full((), 127.0)
        q = torch.round(x32 / scale).clamp(-127, 127).to(torch.int8)
        return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)
    if storage in _FP8_MAX:
        limit = _FP8_MAX[storage]
        return x.float().clamp(-limit, limit).to(storage)
    return x.to(storage)


def dequantize(stored: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize`: [..., stored dim] -> [..., head_dim] in `dtype`."""
    if stored.dtype == torch.int8:
        scale = stored[..., head_dim:].contiguous().view(torch.float32)
        return (stored[..., :head_dim].float() * scale).to(dtype)
    if stored.dtype in _FP8_MAX:
        return _fp8_to_fp16(stored).to(dtype)
    return stored.to(dtype)


def _fp8_to_fp16(stored: torch.Tensor) -> torch.Tensor:
    """fp8 -> float16 by moving bits (the CPU's fp8 cast is slow: 2.7 vs 1.2 ms for 800 k
    e4m3 values here). e5m2 is the upper byte of a float16. e4m3's 4 exponent and 3
    mantissa bits sit at float16's bit 7 upwards; x 2^8 fixes the exponent bias (7 vs 15),
    subnormals included. e4m3's NaN pattern reads as +-480 (never written: quantize
    saturates finite values; a NaN input is garbage either way)."""
    bits = stored.view(torch.uint8).to(torch.int16)
    if stored.dtype == torch.float8_e5m2:
        return (bits << 8).view(torch.float16)
    half = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
    return half.view(torch.float16) * 256.0
