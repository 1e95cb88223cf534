"""LLaMA architecture (RMSNorm, RoPE, SwiGLU, GQA, optional tied embeddings), gpt-fast style.

The forward pass takes one flattened ragged batch: `input_ids`/`positions` of T tokens from
any mix of sequences, the paged KV pool and the step's AttentionMetadata. Q/K/V and gate/up
projections are fused into one matmul each.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models.config import ModelArgs


class Linear(nn.Linear):
    """nn.Linear without random init: weights always come from a checkpoint."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cache(args: ModelArgs, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin tables [max_position_embeddings, head_dim // 2] in fp32."""
    half = args.head_dim // 2
    inv_freq = 1.0 / (
        args.rope_theta ** (torch.arange(0, half, dtype=torch.int64, device=device).float() / half)
    )
    t = torch.arange(args.max_position_embeddings, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos(), freqs.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, H, D]; cos/sin: [T, D/2]. Non-interleaved halves (HF LLaMA convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_size = args.n_heads * args.head_dim
        self.kv_size = args.n_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.dim, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, args.dim, bias=False)
        self.scale = args.head_dim**-0.5

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: "ForwardContext") -> Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(T, self.n_kv_heads, self.head_dim), cos, sin)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        o = ctx.backend.forward(q, k, v, ctx.kv_cache, self.layer, ctx.metadata, self.scale)
        return self.o_proj(o.reshape(T, self.q_size))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inter = args.intermediate_size
        self.gate_up_proj = Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: "ForwardContext") -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class ForwardContext:
    """Per-forward state every attention layer reads: backend, pool, batch metadata."""

    __slots__ = ("backend", "kv_cache", "metadata")

    def __init__(self, backend: AttentionBackend, kv_cache: Tensor, metadata: AttentionMetadata):
        self.backend, self.kv_cache, self.metadata = backend, kv_cache, metadata


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = (
            None if args.tie_word_embeddings else Linear(args.dim, args.vocab_size, bias=False)
        )
        cos, sin = rope_cache(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ctx: ForwardContext,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """Logits [len(logits_indices) or T, vocab] in fp32, only at the rows asked for."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        if logits_indices is not None:
            x = x[logits_indices]
        x = self.norm(x)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head).float()
