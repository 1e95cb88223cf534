"""Where the engine runs and in which dtype (`device` / `dtype` = auto resolved)."""

from __future__ import annotations

import ctypes
import functools
import os

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


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


@functools.cache
def keep_freed_host_memory() -> bool:
    """glibc malloc, once per process: blocks up to 32 MiB come from the heap and freed memory
    stays there (up to 1 GiB) instead of going back to the OS. A prefill step's activations
    (a 1,745-token step: an 11 MB gate/up product, a 5.5 MB SiLU output, ...) are otherwise
    mapped fresh and page-faulted on every touch in every layer: with the AMX prefill kernel
    ~49,000 faults per 16-prompt prefill round, ~10% of its time (docs/benchmarks/serving.md). The
    pool (larger) is mapped as before. Returns whether it applied: not where the user tuned
    malloc already (GLIBC_TUNABLES, MALLOC_*_ variables), not without glibc, and not with
    PDSERVE_MALLOC_TUNING=0."""
    env = os.environ
    if (
        env.get("PDSERVE_MALLOC_TUNING", "1") == "0"
        or "malloc" in env.get("GLIBC_TUNABLES", "")
        or any(k.startswith("MALLOC_") for k in env)
    ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(
            libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
        )
    except (OSError, AttributeError):
        return False
