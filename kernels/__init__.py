"""Triton kernels for the paged engine, each with a plain-torch reference of the same contract.

The references are what the CPU attention backend runs; the kernels run on GPU (or under
TRITON_INTERPRET=1 on CPU, which must be set before this package is imported)."""

from kernels.fused_moe import align_assignments, fused_moe, fused_moe_reference
from kernels.kv_quant import dequantize_kv_reference, kv_format, quantize_kv_reference
from kernels.lora_expand import lora_expand, lora_expand_reference
from kernels.lora_shrink import lora_shrink, lora_shrink_reference
from kernels.paged_attention import (
    AttentionPlan,
    paged_attention,
    paged_attention_reference,
    plan_paged_attention,
)
from kernels.rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from kernels.rope import apply_rope, apply_rope_reference, rope_cos_sin_cache
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_reference
from kernels.store_kv import store_kv, store_kv_reference

__all__ = [
    "AttentionPlan",
    "add_rms_norm",
    "add_rms_norm_reference",
    "apply_rope",
    "apply_rope_reference",
    "align_assignments",
    "dequantize_kv_reference",
    "fused_moe",
    "fused_moe_reference",
    "kv_format",
    "quantize_kv_reference",
    "lora_expand",
    "lora_expand_reference",
    "lora_shrink",
    "lora_shrink_reference",
    "paged_attention",
    "paged_attention_reference",
    "plan_paged_attention",
    "rms_norm",
    "rms_norm_reference",
    "rope_cos_sin_cache",
    "silu_and_mul",
    "silu_and_mul_reference",
    "store_kv",
    "store_kv_reference",
]
