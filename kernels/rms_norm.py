"""RMSNorm, optionally fused with the residual add that precedes it in a LLaMA block.

    rms_norm(x, w, eps)               = x / sqrt(mean(x^2) + eps) * w
    add_rms_norm(x, residual, w, eps) = (rms_norm(x + residual, w, eps), x + residual)
Numerics follow HF LlamaRMSNorm: the sum x + residual is rounded to the input dtype first (it is
the next residual), the statistics are fp32, the normalised value is rounded to the input dtype
before the weight multiply.
"""

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    hidden,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row; the whole row fits in one block (hidden <= a few thousand).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    if HAS_RESIDUAL:
        # Add in fp32, round once to the dtype: that rounded sum is the next residual.
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (xf + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=ok)
        xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(name: str, x: torch.Tensor, hidden: int) -> torch.Tensor:
    check(
        x.dim() >= 1 and x.shape[-1] == hidden,
        f"{name} must be [..., {hidden}], got {tuple(x.shape)}",
    )
    check(x.dtype in FLOAT_DTYPES, f"{name} dtype {x.dtype} not in {FLOAT_DTYPES}")
    rows = x.reshape(-1, hidden)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    check(
        weight.dim() == 1 and weight.stride(0) == 1,
        f"weight must be a contiguous [hidden], got {tuple(weight.shape)} strides "
        f"{weight.stride()}",
    )
    check(weight.dtype in FLOAT_DTYPES, f"weight dtype {weight.dtype} not in {FLOAT_DTYPES}")
    hidden = weight.shape[0]
    x2 = _rows("x", x, hidden)
    check(weight.device == x.device, f"weight is on {weight.device}, x on {x.device}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        check(
            residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device,
            f"residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype}",
        )
        r2 = _rows("residual", residual, hidden)
        residual_out = torch.empty_like(out)
        ro2 = residual_out.view(-1, hidden)
    else:
        r2 = ro2 = residual_out = x2  # unused by the kernel
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            out2,
            ro2,
            x2,
            r2,
            weight,
            eps,
            hidden,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            ro2.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., hidden]; returns a new tensor of x's dtype."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), in one pass; inputs are not modified."""
    return _launch(x, residual, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(summed, weight, eps), summed
