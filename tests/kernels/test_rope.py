"""apply_rope (Triton) == apply_rope_reference (torch) == HF LLaMA rotate_half RoPE."""

import pytest
import torch

from kernels import apply_rope, apply_rope_reference, rope_cos_sin_cache

THETA = 100_000.0
HEAD_DIM = 64
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def _qk(num_tokens, dtype, device="cpu", num_q_heads=9, num_kv_heads=3):
    """q and k as strided views of one fused qkv buffer, like a model's qkv projection output."""
    gen = torch.Generator().manual_seed(0)
    width = (num_q_heads + 2 * num_kv_heads) * HEAD_DIM
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype=dtype, device=device)
    q = qkv[:, : num_q_heads * HEAD_DIM].view(num_tokens, num_q_heads, HEAD_DIM)
    k = qkv[:, num_q_heads * HEAD_DIM : (num_q_heads + num_kv_heads) * HEAD_DIM].view(
        num_tokens, num_kv_heads, HEAD_DIM
    )
    positions = torch.randint(0, 2048, (num_tokens,), generator=gen).to(device)
    return qkv, q, k, positions


def _hf_rope(x, positions, theta):
    # transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb, fp32, written out.
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    rotate_half = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), dim=-1)
    return x.float() * cos + rotate_half.float() * sin


def test_reference_matches_hf_formula():
    _, q, k, positions = _qk(11, torch.float32)
    want_q, want_k = _hf_rope(q, positions, THETA), _hf_rope(k, positions, THETA)
    apply_rope_reference(q, k, positions, rope_cos_sin_cache(HEAD_DIM, 2048, THETA))
    torch.testing.assert_close(q, want_q, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k, want_k, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(dtype, device):
    cache = rope_cos_sin_cache(HEAD_DIM, 2048, THETA, device)
    qkv, q, k, positions = _qk(13, dtype, device)
    ref_qkv, ref_q, ref_k, _ = _qk(13, dtype, device)
    apply_rope(q, k, positions, cache)
    apply_rope_reference(ref_q, ref_k, positions, cache)
    torch.testing.assert_close(qkv, ref_qkv, **TOL[dtype])  # v (the tail) untouched by both
    assert torch.equal(qkv[:, 12 * HEAD_DIM :], _qk(13, dtype, device)[0][:, 12 * HEAD_DIM :])


def test_partial_rotary_dim_leaves_tail(device):
    cache = rope_cos_sin_cache(32, 2048, THETA, device)
    qkv, q, k, positions = _qk(4, torch.float32, device, num_q_heads=2, num_kv_heads=1)
    ref_qkv, ref_q, ref_k, _ = _qk(4, torch.float32, device, num_q_heads=2, num_kv_heads=1)
    apply_rope(q, k, positions, cache)
    apply_rope_reference(ref_q, ref_k, positions, cache)
    torch.testing.assert_close(qkv, ref_qkv, **TOL[torch.float32])
    assert torch.equal(
        q[..., 32:], _qk(4, torch.float32, device, num_q_heads=2, num_kv_heads=1)[1][..., 32:]
    )


def test_rejects_bad_arguments():
    cache = rope_cos_sin_cache(HEAD_DIM, 16, THETA)
    _, q, k, positions = _qk(3, torch.float32)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(q, k, positions.float(), cache)
    with pytest.raises(ValueError, match="q must be"):
        apply_rope(q[:2], k, positions, cache)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rope(q, k, positions, cache[:, :63])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_matches_reference(dtype):
    cache = rope_cos_sin_cache(HEAD_DIM, 8192, THETA, device="cuda")
    qkv, q, k, positions = _qk(8192, dtype, "cuda")
    ref_qkv, ref_q, ref_k, _ = _qk(8192, dtype, "cuda")
    apply_rope(q, k, positions, cache)
    apply_rope_reference(ref_q, ref_k, positions, cache)
    torch.testing.assert_close(qkv, ref_qkv, **TOL[dtype])
