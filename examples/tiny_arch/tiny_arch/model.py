"""TinyForCausalLM: pre-norm decoder, RoPE (interleaved pairs, Meta's original convention),
SwiGLU feed-forward, grouped-query attention, separate LM head — with its own module names:

    embed, blocks.{i}.norm_in, blocks.{i}.attn.{wq,wk,wv,wo}, blocks.{i}.norm_ffn,
    blocks.{i}.ffn.{w1,w2,w3}, norm_out, head

It follows pdserve's model contract (engine/models/interface.py, docs/models.md): a ragged
batch in, attention through the engine's paged attention layer (`ctx.backend.forward`), which
stores K/V in the engine's pool — so prefix caching, chunked prefill and P/D KV transfer work
without anything here knowing about them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.config import ModelArgs
from engine.models.interface import CausalLMBase


def args_from_config(cfg: dict[str, Any]) -> ModelArgs:
    """This architecture's config.json keys -> the sizes the engine reads."""
    return ModelArgs(
        vocab_size=cfg["vocab_size"],
        dim=cfg["d_model"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["n_heads"],
        n_kv_heads=cfg["n_kv_heads"],
        head_dim=cfg["d_model"] // cfg["n_heads"],
        intermediate_size=cfg["ffn_dim"],
        norm_eps=cfg["norm_eps"],
        rope_theta=cfg["rope_base"],
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=False,
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_angles(positions: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos, sin [T, head_dim / 2] in fp32 for the positions of the batch."""
    inv_freq = 1.0 / base ** (
        torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    )
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D]: rotate the pairs (x[2i], x[2i+1]) by position * f_i."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.args = layer, args
        hd = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.scale = hd**-0.5

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx) -> Tensor:
        T, a = x.shape[0], self.args
        q = apply_rope(self.wq(x).view(T, a.n_heads, a.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(T, a.n_kv_heads, a.head_dim), cos, sin)
        v = self.wv(x).view(T, a.n_kv_heads, a.head_dim)
        # the engine's paged attention: stores k/v in its pool, attends over each sequence's blocks
        o = ctx.backend.forward(q, k, v, ctx.kv_cache, self.layer, ctx.metadata, self.scale)
        return self.wo(o.reshape(T, a.n_heads * a.head_dim))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.norm_in = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, layer)
        self.norm_ffn = RMSNorm(args.dim, args.norm_eps)
        self.ffn = FeedForward(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx) -> Tensor:
        h = x + self.attn(self.norm_in(x), cos, sin, ctx)
        return h + self.ffn(self.norm_ffn(h))


class TinyForCausalLM(CausalLMBase):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.blocks = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm_out = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "TinyForCausalLM":
        with torch.device("meta"):  # no init work: load_weights assigns every parameter
            return cls(args_from_config(config))

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in weights:
            layer = re.match(r"blocks\.(\d+)\.", name)
            if layer and int(layer[1]) >= self.args.n_layers:
                continue  # cut off by the loader's num_layers
            if name not in params:
                raise KeyError(name)
            module_name, _, attr = name.rpartition(".")
            setattr(
                self.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False)
            )
            seen.add(name)
        missing = sorted(params.keys() - seen)
        if missing:
            raise KeyError(missing[0])

    def residual(
        self, input_ids: Tensor, positions: Tensor, ctx, num_layers: int | None = None
    ) -> Tensor:
        cos, sin = rope_angles(positions, self.args.head_dim, self.args.rope_theta)
        x = self.embed(input_ids)
        for block in self.blocks[:num_layers]:
            x = block(x, cos, sin, ctx)
        return x

    def hidden(self, x: Tensor, ctx, indices: Tensor | None = None) -> Tensor:
        return self.norm_out(x if indices is None else x[indices])

    def lm_head_weight(self) -> Tensor:
        return self.head.weight
