"""silu_and_mul (Triton) == silu_and_mul_reference (torch) == HF LlamaMLP's act(gate) * up."""

import pytest
import torch

from kernels import silu_and_mul, silu_and_mul_reference

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def _x(rows, intermediate, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(rows, 2 * intermediate, generator=gen) * 4).to(dtype=dtype, device=device)


def test_reference_matches_hf_formula():
    x = _x(5, 1536, torch.float32)
    gate, up = x[:, :1536], x[:, 1536:]
    torch.testing.assert_close(silu_and_mul_reference(x), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("intermediate", [1536, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference(dtype, intermediate, device):
    x = _x(3, intermediate, dtype, device)
    out = silu_and_mul(x)
    assert out.shape == (3, intermediate) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_reference(x), **TOL[dtype])


def test_batched_strided_input(device):
    x = _x(4, 2 * 48, torch.float32, device)[:, ::2].reshape(2, 2, 96)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), **TOL[torch.float32])


def test_rejects_odd_width():
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul(torch.zeros(2, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_matches_reference(dtype):
    x = _x(8192, 1536, dtype, "cuda")
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), **TOL[dtype])
