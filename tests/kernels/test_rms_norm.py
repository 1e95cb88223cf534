"""rms_norm / add_rms_norm (Triton) == their torch references == HF LlamaRMSNorm's formula."""

import pytest
import torch

from kernels import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference

EPS = 1e-5
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def _inputs(rows, hidden, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype=dtype, device=device)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype=dtype, device=device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype=dtype, device=device)
    return x, residual, weight


def _hf_rms_norm(x, weight, eps):
    # transformers' LlamaRMSNorm.forward, written out.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_hf_formula(dtype):
    x, residual, weight = _inputs(7, 576, dtype)
    torch.testing.assert_close(
        rms_norm_reference(x, weight, EPS), _hf_rms_norm(x, weight, EPS), **TOL[dtype]
    )
    normed, summed = add_rms_norm_reference(x, residual, weight, EPS)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(normed, _hf_rms_norm(x + residual, weight, EPS), **TOL[dtype])


@pytest.mark.parametrize("hidden", [576, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype, hidden, device):
    x, _, weight = _inputs(7, hidden, dtype, device)
    torch.testing.assert_close(
        rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS), **TOL[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_add_rms_norm_matches_reference(dtype, device):
    x, residual, weight = _inputs(5, 576, dtype, device)
    x_before, residual_before = x.clone(), residual.clone()
    normed, summed = add_rms_norm(x, residual, weight, EPS)
    ref_normed, ref_summed = add_rms_norm_reference(x, residual, weight, EPS)
    torch.testing.assert_close(summed, ref_summed, **TOL[dtype])
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs modified"


def test_strided_and_batched_input(device):
    x, _, weight = _inputs(6, 2 * 576, torch.float32, device)
    x = x[:, ::2].reshape(2, 3, 576)  # non-contiguous, 3-D
    out = rms_norm(x, weight[:576].contiguous(), EPS)
    assert out.shape == (2, 3, 576)
    torch.testing.assert_close(out, rms_norm_reference(x, weight[:576], EPS), **TOL[torch.float32])


def test_rejects_bad_arguments():
    x, residual, weight = _inputs(3, 64, torch.float32)
    with pytest.raises(ValueError, match="must be"):
        rms_norm(x, weight[:32], EPS)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, residual.half(), weight, EPS)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x.int(), weight, EPS)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        rms_norm(x, torch.zeros(128)[::2], EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_matches_reference(dtype):
    x, residual, weight = _inputs(8192, 576, dtype, "cuda")
    torch.testing.assert_close(
        rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS), **TOL[dtype]
    )
    for got, want in zip(
        add_rms_norm(x, residual, weight, EPS), add_rms_norm_reference(x, residual, weight, EPS)
    ):
        torch.testing.assert_close(got, want, **TOL[dtype])
