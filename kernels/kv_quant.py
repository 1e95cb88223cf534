"""Quantized KV pool formats (vLLM's `kv_cache_dtype`): the encoding, its torch reference, and the
Triton helpers `store_kv` and the attention kernel share. engine/kv/kv_format.py implements the same
encoding for the torch path; the two must stay bit-identical.

A pool's format is known from its dtype and last dim (`D_stored`) alone:
- "auto": the model dtype (fp32/bf16/fp16), D_stored = head_dim, values as given.
- "fp8_e4m3" / "fp8_e5m2": torch.float8_e4m3fn / torch.float8_e5m2, D_stored = head_dim, scale
  1.0: x is clamped to +-448 / +-57344 (saturates instead of NaN/inf) and cast, round to nearest
  even. Read back: the fp8 value, exactly.
- "int8": torch.int8, D_stored = head_dim + 4. Per token and kv head, s = max(max|x|, 1e-8) / 127
  and q = round_half_even(x / s) clamped to [-127, 127], all in fp32 with IEEE division; the row
  is the head_dim values of q, then s as 4 little-endian float32 bytes. Read back: q * s (fp32).
A block is self-describing: its scales live inside it.
"""

import torch
import triton
import triton.language as tl

from kernels._checks import KV_POOL_DTYPES, check

SCALE_BYTES = 4  # int8: one float32 scale per token and kv head, after its head_dim values
FP8_DTYPES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

# Kernel constexpr KV_FORMAT values.
AUTO = tl.constexpr(0)
FP8_E4M3 = tl.constexpr(1)
FP8_E5M2 = tl.constexpr(2)
INT8 = tl.constexpr(3)
_FORMAT_CODES = {"auto": 0, "fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3}


def kv_format(kv_cache: torch.Tensor) -> str:
    """The pool's format, from its dtype: "auto", "fp8_e4m3", "fp8_e5m2" or "int8"."""
    dtype = kv_cache.dtype
    check(dtype in KV_POOL_DTYPES, f"kv_cache dtype {dtype} not in {KV_POOL_DTYPES}")
    return "int8" if dtype == torch.int8 else FP8_DTYPES.get(dtype, "auto")


def format_code(kv_cache: torch.Tensor) -> int:
    """The KV_FORMAT constexpr for the kernels."""
    return _FORMAT_CODES[kv_format(kv_cache)]


def pool_head_dim(kv_cache: torch.Tensor) -> int:
    """head_dim of the values the pool holds (its last dim minus the int8 scale bytes)."""
    d_stored = kv_cache.shape[-1]
    if kv_format(kv_cache) == "int8":
        check(
            d_stored > SCALE_BYTES and (d_stored - SCALE_BYTES) % 4 == 0,
            f"an int8 kv_cache's last dim must be head_dim + {SCALE_BYTES} with head_dim a "
            f"multiple of 4 (4-byte aligned scales), got {d_stored}",
        )
        return d_stored - SCALE_BYTES
    return d_stored


def kernel_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """What the kernels get: fp8 pools as uint8 (the kernels encode/decode the bits themselves;
    Triton has no e4m3 conversion below sm_89 and its interpreter rounds fp8 wrongly)."""
    return kv_cache.view(torch.uint8) if kv_cache.dtype in FP8_DTYPES else kv_cache


def quantize_kv_reference(x: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim] model-dtype values -> the pool's rows for them ([..., head_dim + 4] int8)."""
    if pool_dtype == torch.int8:
        x32 = x.float()
        # A tensor divisor: CUDA torch divides by a Python scalar as a multiply by its
        # reciprocal (one ulp off the correctly rounded quotient the kernels compute).
        scale = x32.abs().amax(-1, keepdim=True).clamp(min=1e-8) / x32.new_full((), 127.0)
        q = torch.round(x32 / scale).clamp(-127, 127).to(torch.int8)  # round: half to even
        return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)
    if pool_dtype in FP8_MAX:
        limit = FP8_MAX[pool_dtype]
        return x.float().clamp(-limit, limit).to(pool_dtype)
    return x.to(pool_dtype)


def dequantize_kv_reference(stored: torch.Tensor) -> torch.Tensor:
    """Pool rows [..., D_stored] -> fp32 values [..., head_dim] (the inverse of the above)."""
    if stored.dtype == torch.int8:
        head_dim = stored.shape[-1] - SCALE_BYTES
        scale = stored[..., head_dim:].contiguous().view(torch.float32)
        return stored[..., :head_dim].float() * scale
    return stored.float()


# ---- Triton helpers (bit-exact with the references above, on GPU and under the interpreter) ----


@triton.jit
def _shift_right_rne(m, shift):
    """m >> shift (int32, m >= 0, 1 <= shift <= 25), rounded to nearest, ties to even."""
    half = (1 << (shift - 1)) - 1
    return (m + half + ((m >> shift) & 1)) >> shift


@triton.jit
def encode_fp8(x, KV_FORMAT: tl.constexpr):
    """fp32 -> fp8 bits (uint8) as `x.clamp(-max, max).to(fp8)` in torch: saturating, round to
    nearest even, NaN -> sign | 0x7F. Integer arithmetic only (no fp8 types needed)."""
    if KV_FORMAT == FP8_E4M3:
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        MAX: tl.constexpr = 448.0
    else:
        # Triton declares a constexpr per branch; mypy reads these as redefinitions.
        MANT: tl.constexpr = 2  # type: ignore[no-redef]
        BIAS: tl.constexpr = 15  # type: ignore[no-redef]
        MAX: tl.constexpr = 57344.0  # type: ignore[no-redef]
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.maximum(x, -MAX), MAX).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    exp = a >> 23
    # Normal in fp8: rebias the exponent, drop mantissa bits (a carry rolls into the exponent).
    normal = _shift_right_rne(a - ((127 - BIAS) << 23), 23 - MANT)
    # Subnormal in fp8: the significand (with its implicit bit) in units of the smallest step.
    sub_shift = tl.minimum(tl.maximum(24 - BIAS - MANT - (exp - 127), 1), 25)
    sub = _shift_right_rne((a & 0x7FFFFF) | 0x800000, sub_shift)
    bits = sign | tl.where(exp >= 128 - BIAS, normal, sub)
    return tl.where(x != x, sign | 0x7F, bits).to(tl.uint8)


@triton.jit
def decode_e4m3(bits):
    """e4m3 bits (uint8) -> the exact value as fp16 (Triton has no e4m3 conversion below sm_89).
    e5m2 needs no helper: it is the top byte of an fp16, and Triton converts it natively."""
    b = bits.to(tl.uint16)
    # e4m3 read with fp16's exponent bias (15 - 7 = 8 too low), then * 2^8: exact, subnormals too.
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    h = tl.where((b & 0x7F) == 0x7F, h | 0x7E00, h)  # NaN stays NaN (never stored from finite x)
    return h.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def quantize_int8(x):
    """x [rows, cols] fp32 (padding lanes 0) -> (q int8 [rows, cols], s fp32 [rows]), per row."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-8), 127.0)
    y = tl.math.div_rn(x, scale[:, None])
    # Round half to even, from floor (exact for |y| < 2^23) so that it is the same everywhere.
    low = tl.floor(y)
    frac = y - low
    q = low.to(tl.int32)
    q += ((frac > 0.5) | ((frac == 0.5) & ((q & 1) == 1))).to(tl.int32)
    return tl.minimum(tl.maximum(q, -127), 127).to(tl.int8), scale
