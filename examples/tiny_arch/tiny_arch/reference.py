"""A plain-torch reference for TinyForCausalLM: one sequence, no paging, no engine — dense
causal attention over the whole sequence recomputed every step, RoPE by complex rotation.
What the engine's output (paged KV, chunked prefill, prefix cache, P/D transfer) must equal."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tiny_arch.model import TinyForCausalLM, rms_norm


def _rope(x: Tensor, base: float) -> Tensor:
    """x [T, H, D] at positions 0..T-1, pairs (2i, 2i+1) as complex numbers."""
    T, _, D = x.shape
    freqs = 1.0 / base ** (torch.arange(0, D, 2).float() / D)
    rot = torch.polar(torch.ones(T, D // 2), torch.outer(torch.arange(T).float(), freqs))
    z = torch.view_as_complex(x.float().reshape(T, -1, D // 2, 2).contiguous()) * rot[:, None, :]
    return torch.view_as_real(z).flatten(-2).to(x.dtype)


@torch.inference_mode()
def reference_logits(model: TinyForCausalLM, token_ids: list[int]) -> Tensor:
    """Logits [T, vocab] (fp32) of one sequence."""
    a = model.args
    x = model.embed.weight[torch.tensor(token_ids)]
    T = x.shape[0]
    for blk in model.blocks:
        h = rms_norm(x, blk.norm_in.weight, a.norm_eps)
        q = _rope((h @ blk.attn.wq.weight.T).view(T, a.n_heads, a.head_dim), a.rope_theta)
        k = _rope((h @ blk.attn.wk.weight.T).view(T, a.n_kv_heads, a.head_dim), a.rope_theta)
        v = (h @ blk.attn.wv.weight.T).view(T, a.n_kv_heads, a.head_dim)
        group = a.n_heads // a.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=a.head_dim**-0.5,
        )
        x = x + o.transpose(0, 1).reshape(T, -1) @ blk.attn.wo.weight.T
        h = rms_norm(x, blk.norm_ffn.weight, a.norm_eps)
        f = blk.ffn
        x = x + (F.silu(h @ f.w1.weight.T) * (h @ f.w3.weight.T)) @ f.w2.weight.T
    return (rms_norm(x, model.norm_out.weight, a.norm_eps) @ model.head.weight.T).float()


def reference_greedy(
    model: TinyForCausalLM,
    prompt: list[int],
    max_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Greedy continuation of `prompt` (stops after an EOS id, which is included)."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        nxt = int(reference_logits(model, tokens)[-1].argmax())
        tokens.append(nxt)
        out.append(nxt)
        if nxt in eos_ids:
            break
    return out
