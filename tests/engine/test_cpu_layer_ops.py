"""The C++ layer ops (engine/cpu_kernels/layer_ops.cpp) against the plain-torch references of
the Triton kernels with the same contracts (kernels/*.py) and the model layers' own torch path:
odd widths (vector tails), strided q/k views of a fused qkv, partial rotary dims, every float
dtype; bf16 results equal the layers' torch path bit for bit."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kernels
from engine import cpu_kernels
from engine.models.layers import RMSNorm, apply_rope, rope_rows

pytestmark = pytest.mark.skipif(
    not cpu_kernels.load(), reason="no C++ toolchain for the CPU kernels"
)
OPS = cpu_kernels.LAYER_OPS
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = list(TOL)


def _close(a, b, dtype):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 576), (5, 72), (3, 7)])
def test_rms_norm_and_add_rms_norm(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x, res = (torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(hidden, generator=gen).to(dtype)
    x_before, res_before = x.clone(), res.clone()
    _close(OPS.rms_norm(x, w, 1e-5), kernels.rms_norm_reference(x, w, 1e-5), dtype)
    normed, summed = OPS.add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_summed = kernels.add_rms_norm_reference(x, res, w, 1e-5)
    assert torch.equal(summed, ref_summed)  # one rounding of an exact fp32 sum
    _close(normed, ref_normed, dtype)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs untouched
    heads = torch.cat((x, res), dim=-1).view(rows, 2, hidden)[:, 0]  # a strided view (q_norm's)
    _close(OPS.rms_norm(heads, w, 1e-5), kernels.rms_norm_reference(heads, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 24, 9])
def test_silu_and_mul(dtype, width):
    x = torch.randn(2, 3, 2 * width, generator=torch.Generator().manual_seed(width)).to(dtype)
    out = OPS.silu_and_mul(x)
    assert out.shape == (2, 3, width)
    _close(out, kernels.silu_and_mul_reference(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary", [(64, 64), (48, 32)])
def test_rope_in_place_on_views_of_a_fused_qkv(dtype, head_dim, rotary):
    tokens, hq, hk = 11, 6, 2
    gen = torch.Generator().manual_seed(head_dim + rotary)
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    table = kernels.rope_cos_sin_cache(rotary, 512, 10000.0)
    ours, ref = qkv.clone(), qkv.clone()
    for t, apply in ((ours, OPS.apply_rope), (ref, kernels.apply_rope_reference)):
        q = t[:, : hq * head_dim].view(tokens, hq, head_dim)
        k = t[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
        apply(q, k, positions, table)
    _close(ours, ref, dtype)
    v = slice((hq + hk) * head_dim, None)
    assert torch.equal(ours[:, v], qkv[:, v])  # v is not touched


def test_bf16_equals_the_layers_torch_path():
    """What the model computed before these ops, bit for bit in bf16 (the fp32 statistics
    are summed in another order, which bf16 rounding hides)."""
    gen = torch.Generator().manual_seed(0)
    x, a = (torch.randn(16, 576, generator=gen).bfloat16() for _ in range(2))
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=gen).bfloat16()
    plain = SimpleNamespace(layer_ops=None)
    assert torch.equal(OPS.rms_norm(x, norm.weight, 1e-5), norm(x, plain))
    fused = OPS.add_rms_norm(a, x, norm.weight, 1e-5)
    assert all(torch.equal(f, p) for f, p in zip(fused, norm.add_and_norm(a, x, plain)))
    gate_up = torch.randn(16, 2 * 1536, generator=gen).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(OPS.silu_and_mul(gate_up), F.silu(gate) * up)
    table = kernels.rope_cos_sin_cache(64, 4096, 10000.0)
    positions = torch.randint(0, 4096, (16,), generator=gen)
    qk = torch.randn(16, 12, 64, generator=gen).bfloat16()
    expected = apply_rope(qk, rope_rows(table, positions))
    OPS.apply_rope(qk[:, :9], qk[:, 9:], positions, table)
    assert torch.equal(qk, expected)


def test_bad_inputs_are_refused_by_name():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight"):
        OPS.rms_norm(x, torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        OPS.add_rms_norm(x.t(), x.t(), torch.randn(4), 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        OPS.silu_and_mul(torch.randn(2, 7))
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        OPS.apply_rope(q, k, torch.tensor([0, 9]), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="x's dtype"):
        OPS.rms_norm(x, torch.randn(8).bfloat16(), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_the_bytes_the_torch_store_writes(dtype):
    """Strided K/V views of a fused qkv, skipped slots (-1), two layers, a partly filled block:
    the pool afterwards equals the torch backend's store_kv_torch, byte for byte."""
    from engine.attention.torch_backend import store_kv_torch

    gen = torch.Generator().manual_seed(3)
    num_blocks, layers, block, heads, dim = 5, 2, 4, 3, 16
    pool = torch.randn(num_blocks, heads, layers, 2, block, dim, generator=gen).to(dtype)
    qkv = torch.randn(6, (9 + 2 * heads) * dim, generator=gen).to(dtype)
    _, k, v = qkv.split([9 * dim, heads * dim, heads * dim], dim=-1)
    k, v = k.view(6, heads, dim), v.view(6, heads, dim)
    slots = torch.tensor([0, 5, -1, 19, 7, -1])
    assert cpu_kernels.stores_in_place(k, v, pool)
    for layer in range(layers):
        ours, ref = pool.clone(), pool.clone()
        cpu_kernels.store_kv_(k, v, ours, layer, slots)
        store_kv_torch(k, v, ref, layer, slots)
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
        assert not torch.equal(ours, pool)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.store_kv_(
            k, v, pool.clone(), 0, torch.tensor([0, 1, 2, 3, 4, num_blocks * block])
        )
    with pytest.raises(RuntimeError, match="layer out of range"):
        cpu_kernels.store_kv_(k, v, pool.clone(), layers, slots)
    # Quantized pools and heads that are not contiguous per token keep the torch path.
    assert not cpu_kernels.stores_in_place(k, v, pool.to(torch.float8_e4m3fn))
    assert not cpu_kernels.stores_in_place(k.transpose(0, 1), v.transpose(0, 1), pool)
