"""LLaMA architecture (RMSNorm, RoPE, SwiGLU, GQA, optional tied embeddings), gpt-fast style.

The forward pass takes one flattened ragged batch: `input_ids`/`positions` of T tokens from
any mix of sequences, the paged KV pool and the step's AttentionMetadata. Q/K/V and gate/up
projections are fused into one matmul each. With `use_fused_kernels(True)` (the engine does
this with the Triton attention backend) RMSNorm, RoPE and SiLU-and-mul run as Triton kernels.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models.config import ModelArgs

if TYPE_CHECKING:
    from engine.lora.batch import LoRABatch


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

    def forward(self, x: Tensor, ctx: "ForwardContext") -> Tensor:
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
        self.qkv_proj = Linear(args.dim, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, args.dim, bias=False)
        self.scale = args.head_dim**-0.5

    def forward(self, x: Tensor, ctx: "ForwardContext") -> Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if ctx.lora is not None:
            ctx.lora.add(qkv, x, self.layer, (("q_proj", 0), ("k_proj", self.q_size),
                                              ("v_proj", self.q_size + self.kv_size)))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.head_dim)
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

    def forward(self, x: Tensor, ctx: "ForwardContext") -> Tensor:
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

    def forward(self, x: Tensor, ctx: "ForwardContext") -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x, ctx), ctx)
        return h + self.mlp(self.post_attention_layernorm(h, ctx), ctx)


class ForwardContext:
    """Per-forward state every layer reads: attention backend, pool, batch metadata; the
    Transformer fills in positions and RoPE tables, and the kernels module when fused."""

    __slots__ = ("backend", "kv_cache", "metadata", "positions", "rope_cos_sin", "cos_sin", "kernels",
                 "lora")

    def __init__(self, backend: AttentionBackend, kv_cache: Tensor, metadata: AttentionMetadata,
                 lora: "LoRABatch | None" = None):
        self.backend, self.kv_cache, self.metadata = backend, kv_cache, metadata
        self.positions = self.rope_cos_sin = self.cos_sin = self.kernels = None
        self.lora = lora  # the step's adapters (engine/lora/batch.py); None: no row has one


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
        self.register_buffer("rope_cos_sin", rope_cache(args), persistent=False)
        self.kernels = None  # the `kernels` package when fused Triton ops are on

    @classmethod
    def from_config(cls, config: dict) -> "Transformer":
        """The model contract's constructor (engine/models/interface.py); parameters
        uninitialised."""
        return cls(ModelArgs.from_hf_config(config))

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """HF LLaMA tensors by name (q/k/v and gate/up fused here); layers past
        `args.n_layers` are skipped. The loader's fast path does the same on a dict."""
        from engine.models.loader import hf_llama_to_ours

        self.load_state_dict(hf_llama_to_ours(dict(weights), self.args), strict=True, assign=True)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ctx: ForwardContext,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """Logits [len(logits_indices) or T, vocab] in fp32, only at the rows asked for."""
        return self.logits(self.residual(input_ids, positions, ctx), ctx, logits_indices)

    def residual(
        self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, num_layers: int | None = None
    ) -> Tensor:
        """The residual stream after the last layer, [T, dim] (before the final norm).
        `num_layers`: stop after the first N layers (a layer-skip self-draft)."""
        ctx.positions, ctx.rope_cos_sin, ctx.kernels = positions, self.rope_cos_sin, self.kernels
        if self.kernels is None:
            ctx.cos_sin = self.rope_cos_sin[positions]
        x = self.embed_tokens(input_ids)
        for layer in self.layers[:num_layers]:
            x = layer(x, ctx)
        return x

    def logits(self, x: Tensor, ctx: ForwardContext, indices: Tensor | None = None) -> Tensor:
        """LM-head logits [len(indices) or T, vocab] fp32 at rows `indices` of `residual`'s
        output."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.hidden(x, ctx, indices), head).float()

    def compute_logits(self, x: Tensor, ctx: ForwardContext, indices: Tensor | None = None) -> Tensor:
        """vLLM's name for `logits`."""
        return self.logits(x, ctx, indices)

    def hidden(self, x: Tensor, ctx: ForwardContext, indices: Tensor | None = None) -> Tensor:
        """The final-normed hidden state at rows `indices` (what pooling and the LM head
        read), in the model's dtype."""
        if indices is not None:
            x = x[indices]
        return self.norm(x, ctx)

    def use_fused_kernels(self, enabled: bool) -> None:
        """Route RMSNorm, RoPE and SiLU-and-mul through the Triton kernels (CUDA, or CPU under
        TRITON_INTERPRET=1)."""
        if enabled:
            import kernels

            self.kernels = kernels
        else:
            self.kernels = None
