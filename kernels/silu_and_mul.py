"""SwiGLU activation of a LLaMA MLP whose gate and up projections are fused into one matmul:
x [..., 2 * intermediate] = [gate | up]  ->  silu(gate) * up  [..., intermediate].
Math is fp32, the result is rounded once to x's dtype.
"""

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def _check_args(x: torch.Tensor) -> None:
    check(
        x.dim() >= 1 and x.shape[-1] % 2 == 0,
        f"x must be [..., 2 * intermediate], got {tuple(x.shape)}",
    )
    check(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} not in {FLOAT_DTYPES}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2d]; returns a new [..., d] tensor."""
    _check_args(x)
    width = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * width)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, width)
    if rows.shape[0] > 0 and width > 0:
        block = min(BLOCK, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](
            out2, rows, width, rows.stride(0), out2.stride(0), BLOCK=block
        )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    _check_args(x)
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
