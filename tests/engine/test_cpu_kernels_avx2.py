"""The CPU kernels' AVX2 paths (vec16.h: 16 lanes as two ymm halves), on an AVX-512 host.

A host with AVX-512 builds and tests only the AVX-512 paths in this process, yet many users'
CPUs stop at AVX2 (their `dtype=auto` is float32). Here the kernel tests, the packed-linear
tests and the engine's greedy parity with HF transformers run again in a child process as
such a CPU would: the kernels built with -march=x86-64-v3 (AVX2 + FMA + F16C, no AVX-512),
ATen's kernels at AVX2 and oneDNN capped at AVX2 (no bf16 packing). On an AVX2-only host the
main run covers all of this already."""

import pytest
from emulated_host import cpu_has, run_as, run_tests_as

from engine import cpu_kernels

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


pytestmark = pytest.mark.skipif(
    not cpu_kernels.load()
    or cpu_kernels.vector_isa() != "avx512"
    or not cpu_has("avx2", "fma", "f16c"),
    reason="needs an AVX-512 host with a C++ toolchain (an AVX2 host tests these paths natively)",
)


def test_kernels_and_engine_on_an_avx2_host():
    script = (
        "from engine import cpu_kernels; import torch\nassert cpu_kernels.load()\n"
        "print(cpu_kernels.vector_isa(), torch.backends.cpu.get_cpu_capability(),"
        " torch.ops.mkldnn._is_mkldnn_bf16_supported())"
    )
    probe = run_as(AVX2_HOST, ["-c", script], timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split() == ["avx2", "AVX2", "False"]
    run_tests_as(AVX2_HOST, TESTS, timeout=600)
