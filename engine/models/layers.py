"""The building blocks of HF-layout decoder models (LLaMA, Qwen2, Qwen3), gpt-fast style:
RMSNorm, RoPE, GQA attention through the engine's paged attention backend, SwiGLU MLP and the
pre-norm decoder block. Per-architecture options come from ModelArgs: `qkv_bias`, `o_bias`
(projection biases), `qk_norm` (per-head RMSNorm on q and k before RoPE) and `head_dim`
(which may differ from dim // n_heads). With `ctx.kernels` set (the Triton attention backend)
RMSNorm, RoPE and SiLU-and-mul run as Triton kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.config import ModelArgs
from engine.models.interface import ForwardContext


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

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        if ctx.kernels is not None:
            return ctx.kernels.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cache(args: ModelArgs, device: torch.device | None = None) -> Tensor:
    """[max_position_embeddings, head_dim] fp32: cos(pos * f_i) | sin(pos * f_i)."""
    half = args.head_dim // 2
    inv_freq = 1.0 / (
        args.rope_theta ** (torch.arange(0, half, dtype=torch.int64, device=device).float() / half)
    )
    t = torch.arange(args.max_position_embeddings, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def apply_rope(x: Tensor, cos_sin: Tensor) -> Tensor:
    """x: [T, H, D]; cos_sin: [T, D] (cos | sin). Non-interleaved halves (HF convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_size = args.n_heads * args.head_dim
        self.kv_size = args.n_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.dim, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = Linear(self.q_size, args.dim, bias=args.o_bias)
        self.scale = args.head_dim**-0.5
        # Qwen3: RMSNorm over each head's head_dim, before RoPE.
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if ctx.lora is not None:
            ctx.lora.add(qkv, x, self.layer, (("q_proj", 0), ("k_proj", self.q_size),
                                              ("v_proj", self.q_size + self.kv_size)))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, ctx), self.k_norm(k, ctx)
        if ctx.kernels is not None:
            ctx.kernels.apply_rope(q, k, ctx.positions, ctx.rope_cos_sin)  # in place
        else:
            q, k = apply_rope(q, ctx.cos_sin), apply_rope(k, ctx.cos_sin)
        o = ctx.backend.forward(q, k, v, ctx.kv_cache, self.layer, ctx.metadata, self.scale)
        o = o.reshape(T, self.q_size)
        out = self.o_proj(o)
        if ctx.lora is not None:
            ctx.lora.add(out, o, self.layer, (("o_proj", 0),))
        return out


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.inter = args.intermediate_size
        self.gate_up_proj = Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if ctx.lora is not None:
            ctx.lora.add(gate_up, x, self.layer, (("gate_proj", 0), ("up_proj", self.inter)))
        if ctx.kernels is not None:
            h = ctx.kernels.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split([self.inter, self.inter], dim=-1)
            h = F.silu(gate) * up
        out = self.down_proj(h)
        if ctx.lora is not None:
            ctx.lora.add(out, h, self.layer, (("down_proj", 0),))
        return out


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args, layer)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x, ctx), ctx)
        return h + self.mlp(self.post_attention_layernorm(h, ctx), ctx)
