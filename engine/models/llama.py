"""LLaMA architecture (RMSNorm, RoPE, SwiGLU, GQA, optional tied embeddings), gpt-fast style.

The forward pass takes one flattened ragged batch: `input_ids`/`positions` of T tokens from
any mix of sequences and a ForwardContext (engine/models/interface.py: the paged KV pool and
the step's AttentionMetadata). Q/K/V and gate/up projections are fused into one matmul each;
the HF checkpoint's names map onto them here (`load_weights`, `update_weights`). With
`use_fused_kernels(True)` (the engine does this with the Triton attention backend) RMSNorm,
RoPE and SiLU-and-mul run as Triton kernels.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.config import ModelArgs
from engine.models.interface import CausalLMBase, ForwardContext
from engine.weights import copy_weights


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
        self.qkv_proj = Linear(args.dim, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, args.dim, bias=False)
        self.scale = args.head_dim**-0.5

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


class Transformer(CausalLMBase):
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
        """HF LLaMA tensors by name, fused (q/k/v, gate/up) and assigned in one go; layers
        past `args.n_layers` are skipped; KeyError names a missing tensor."""
        self.load_state_dict(_fused_state_dict(dict(weights), self.args), strict=True, assign=True)

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """HF-named tensors copied in place, each into the parameter (or the row range of a
        fused one) that holds it."""
        return copy_weights(self._weight_target, weights)

    def _apply(self, fn, recurse=True):
        # The RoPE table stays fp32 whatever the dtype: after any move or cast it is rebuilt
        # (on the CPU, as at construction) and follows the parameters to their device.
        super()._apply(fn, recurse)
        self.rope_cos_sin = rope_cache(self.args).to(self.embed_tokens.weight.device)
        return self

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

    def lm_head_weight(self) -> Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

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

    def _weight_target(self, name: str) -> Tensor | None:
        """The tensor (a row range of a fused one) that HF weight `name` lives in; None for a
        layer this (truncated) model does not have; KeyError for a name it has no place for."""
        args = self.args
        if name == "model.embed_tokens.weight":
            return self.embed_tokens.weight
        if name == "model.norm.weight":
            return self.norm.weight
        if name == "lm_head.weight":
            return self.lm_head_weight()
        m = _HF_LAYER.match(name)
        if m is None:
            raise KeyError(name)
        layer_no, part, proj = int(m.group(1)), m.group(2), m.group(3)
        if layer_no >= args.n_layers:
            return None
        layer = self.layers[layer_no]
        if part in ("input_layernorm", "post_attention_layernorm") and proj is None:
            return getattr(layer, part).weight
        q, kv, inter = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.intermediate_size
        rows = {("self_attn", "q_proj"): ("qkv_proj", 0, q), ("self_attn", "k_proj"): ("qkv_proj", q, kv),
                ("self_attn", "v_proj"): ("qkv_proj", q + kv, kv), ("self_attn", "o_proj"): ("o_proj", 0, None),
                ("mlp", "gate_proj"): ("gate_up_proj", 0, inter), ("mlp", "up_proj"): ("gate_up_proj", inter, inter),
                ("mlp", "down_proj"): ("down_proj", 0, None)}
        if (part, proj) not in rows:
            raise KeyError(name)
        param, start, length = rows[(part, proj)]
        weight = getattr(layer.self_attn if part == "self_attn" else layer.mlp, param).weight
        return weight if length is None else weight[start : start + length]


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp|input_layernorm|post_attention_layernorm)"
                       r"(?:\.(\w+))?\.weight$")


def _fused_state_dict(hf: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """HF LLaMA names -> this module's names (q/k/v and gate/up fused)."""
    out = {
        "embed_tokens.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
    }
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        out[f"layers.{i}.input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[f"layers.{i}.post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"]]
        )
        out[f"layers.{i}.self_attn.o_proj.weight"] = hf[attn + "o_proj.weight"]
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]
        )
        out[f"layers.{i}.mlp.down_proj.weight"] = hf[mlp + "down_proj.weight"]
    return out
