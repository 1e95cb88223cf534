"""The prefill kernel's AVX512-BF16 products (paged_prefill.cpp without AMX: `vdpbf16ps`), on
an AMX host.

An AMX host builds and tests only the AMX tiles in this process, yet Zen 4 and Cooper Lake
CPUs run the vdpbf16ps version. Here the prefill kernel's tests run again in a child process
as such a CPU would: the kernels built with -march=cooperlake (AVX-512 with BF16, no AMX) and
oneDNN capped below AMX. On a CPU with AVX512-BF16 and no AMX the main run covers this."""

import pytest
from emulated_host import cpu_has, run_as, run_tests_as

from engine import cpu_kernels

AVX512_BF16_HOST = {
    "PDSERVE_CPU_KERNELS_MARCH": "cooperlake",
    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
}


pytestmark = pytest.mark.skipif(
    not cpu_has("amx_bf16", "amx_tile", "avx512_bf16") or not cpu_kernels.load(),
    reason="needs an AMX host with a C++ toolchain "
    "(an AVX512-BF16 host without AMX tests this natively)",
)


def test_prefill_kernel_on_an_avx512_bf16_host():
    script = (
        "from engine import cpu_kernels; import torch\n"
        "assert cpu_kernels.load()\n"
        "print(torch.ops.pdserve_cpu.prefill_isa())"
    )
    probe = run_as(AVX512_BF16_HOST, ["-c", script], timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split() == ["avx512_bf16"]
    run_tests_as(AVX512_BF16_HOST, ["tests/engine/test_cpu_prefill_kernel.py"], timeout=600)
