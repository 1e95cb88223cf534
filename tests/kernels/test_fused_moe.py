"""fused_moe (Triton grouped GEMMs) == fused_moe_reference (torch, expert by expert) == the
per-token formula; align_assignments groups every assignment exactly once."""

import pytest
import torch

from kernels import align_assignments, fused_moe, fused_moe_reference

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _problem(num_tokens, dtype, device="cpu", experts=4, top_k=2, dim=32, inter=24, skew=False):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, dim, generator=gen)
    w13 = torch.randn(experts, 2 * inter, dim, generator=gen) / dim**0.5
    w2 = torch.randn(experts, dim, inter, generator=gen) / inter**0.5
    logits = torch.randn(num_tokens, experts, generator=gen)
    if skew:  # every token picks experts 0 and 2: the others get nothing
        logits[:, [0, 2]] += 100
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return [t.to(device) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def _per_token(x, w13, w2, weights, ids):
    """The formula, one (token, k) at a time, in fp32."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (w13[e].float() @ x[t].float()).split([inter, inter])
            out[t] += weights[t, k] * (w2[e].float() @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_reference_matches_per_token_formula(num_tokens):
    args = _problem(num_tokens, torch.float32)
    torch.testing.assert_close(fused_moe_reference(*args), _per_token(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens,block_m", [(1, 16), (5, 4), (33, 16), (40, 8)])
def test_alignment_groups_each_assignment_once(num_tokens, block_m):
    ids = _problem(num_tokens, torch.float32, experts=4, top_k=2)[4]
    align = align_assignments(ids, 4, block_m)
    n = ids.numel()
    sorted_ids, blocks = align.sorted_ids.long(), align.block_experts.long()
    assert sorted_ids.numel() == blocks.numel() * block_m
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))
    assert (sorted_ids[sorted_ids >= n] == n).all()  # padding is the sentinel
    used = blocks >= 0
    assert used.sum() > 0 and not used[used.sum() :].any()  # used blocks first, then -1
    for b, e in enumerate(blocks.tolist()):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        rows = rows[rows < n]
        assert (e >= 0) == (rows.numel() > 0)
        assert (ids.reshape(-1)[rows] == e).all()
        assert (rows.diff() > 0).all()  # token order within an expert


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(num_tokens, dtype, device):
    args = _problem(num_tokens, dtype, device)
    out = fused_moe(*args)
    assert out.shape == (num_tokens, 32) and out.dtype == dtype
    torch.testing.assert_close(out, fused_moe_reference(*args), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_skewed_routing_and_top1(dtype, device):
    args = _problem(33, dtype, device, skew=True)  # experts 1 and 3 idle: their blocks absent
    torch.testing.assert_close(fused_moe(*args), fused_moe_reference(*args), **TOL[dtype])
    args = _problem(7, dtype, device, top_k=1, dim=48, inter=40)  # dims not powers of two
    torch.testing.assert_close(fused_moe(*args), fused_moe_reference(*args), **TOL[dtype])


def test_int32_ids_and_model_dtype_weights(device):
    x, w13, w2, weights, ids = _problem(5, torch.bfloat16, device)
    args = (x, w13, w2, weights.to(torch.bfloat16), ids.to(torch.int32))
    torch.testing.assert_close(fused_moe(*args), fused_moe_reference(*args), **TOL[torch.bfloat16])


def test_rejects_mismatched_shapes():
    x, w13, w2, weights, ids = _problem(3, torch.float32)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_moe(x, w13, w2[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="dtypes differ"):
        fused_moe(x.half(), w13, w2, weights, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_reference(num_tokens, dtype):
    args = _problem(num_tokens, dtype, "cuda", experts=64, top_k=8, dim=2048, inter=768)
    torch.testing.assert_close(fused_moe(*args), fused_moe_reference(*args), atol=3e-2, rtol=2e-2)
