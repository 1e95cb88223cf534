"""The CPU kernels' AVX2 paths (vec16.h: 16 lanes as two ymm halves), on an AVX-512 host.

A host with AVX-512 builds and tests only the AVX-512 paths in this process, yet many users'
CPUs stop at AVX2 (their `dtype=auto` is float32). Here the kernel tests, the packed-linear
tests and the engine's greedy parity with HF transformers run again in a child process as
such a CPU would: the kernels built with -march=x86-64-v3 (AVX2 + FMA + F16C, no AVX-512),
ATen's kernels at AVX2 and oneDNN capped at AVX2 (no bf16 packing). On an AVX2-only host the
main run covers all of this already."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
AVX2_HOST = {
    "PDSERVE_CPU_KERNELS_MARCH": "x86-64-v3",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
TESTS = [
    "tests/engine/test_cpu_decode_kernel.py",
    "tests/engine/test_cpu_layer_ops.py",
    "tests/engine/test_sampler_batched.py",
    "tests/engine/test_packed_linears.py",
    "tests/engine/test_engine_parity.py::test_default_settings",
]


def _cpu_has(*flags: str) -> bool:
    words = set(cpu_kernels._cpu_flags().split())
    return all(f in words for f in flags)


pytestmark = pytest.mark.skipif(
    not cpu_kernels.load() or cpu_kernels.vector_isa() != "avx512" or not _cpu_has("avx2", "fma", "f16c"),
    reason="needs an AVX-512 host with a C++ toolchain (an AVX2 host tests these paths natively)")


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, **AVX2_HOST}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_kernels_and_engine_on_an_avx2_host():
    probe = _run(["-c", "from engine import cpu_kernels; import torch\n"
                        "assert cpu_kernels.load()\n"
                        "print(cpu_kernels.vector_isa(), torch.backends.cpu.get_cpu_capability(),"
                        " torch.ops.mkldnn._is_mkldnn_bf16_supported())"], timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split() == ["avx2", "AVX2", "False"]
    run = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout.splitlines()[-1]
