"""The CPU every benchmark names beside its numbers (machines here differ: some AVX-512 with
AVX512-BF16 and AMX, some AVX2 only, where bf16 is emulated)."""

from __future__ import annotations

from pathlib import Path


def cpu_isa() -> str:
    """E.g. "Intel(R) Xeon(R) Processor, AVX-512+AVX512-BF16+AMX" or "..., AVX2 (no AMX)":
    the model name and the vector extensions that decide speed, from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    lines = text.splitlines()
    name = next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
        "unknown CPU",
    )
    flags = set(
        next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    )
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    if "avx512_bf16" in flags:
        isa += "+AVX512-BF16"
    return f"{name}, {isa}" + ("+AMX" if "amx_tile" in flags else " (no AMX)")
