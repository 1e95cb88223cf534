"""Every kernel variant the launchers produce compiles to a cubin for sm_90 (H100/H200) and
sm_80 (A100), with no GPU needed: the interpreter alone would miss compile-only errors. The
bf16/fp16 variants must also compile without register spills."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

SCRIPT = Path(__file__).with_name("aot_compile.py")


@pytest.mark.skipif(
    "nvidia" not in getattr(triton.backends, "backends", {}),
    reason="triton's NVIDIA backend is not installed",
)
@pytest.mark.parametrize("arch", [90, 80])
def test_kernels_compile_for_nvidia(arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", str(arch)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compiled = proc.stdout.splitlines()
    assert sum("paged_attention_kernel" in line for line in compiled) >= 6
    assert sum("'USE_WINDOW': True, 'USE_SOFT_CAP': True" in line for line in compiled) >= 4
    for kv_format in (1, 2, 3):  # quantized pools: fp8_e4m3, fp8_e5m2, int8
        assert sum(f"'KV_FORMAT': {kv_format}" in line for line in compiled) >= 4, kv_format
    # Serving dtypes must not spill registers (fp32 is a test dtype; its prefill tile does spill).
    # Known exception: on sm_80 the fp8_e5m2 attention variants spill 8-16 bytes (docs/kernels.md).
    spilling = [
        line
        for line in compiled
        if "fp32" not in line
        and "stack=0" not in line
        and not (arch == 80 and "'KV_FORMAT': 2" in line)
    ]
    assert not spilling, spilling
    assert all(
        any(name in line for line in compiled)
        for name in (
            "merge_partitions_kernel",
            "_store_kv_kernel",
            "_rms_norm_kernel",
            "_rope_kernel",
            "_silu_and_mul_kernel",
            "_lora_shrink_kernel",
            "_lora_expand_kernel",
        )
    )
