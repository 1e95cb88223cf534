"""A decoder-only model in the HF checkpoint layout shared by LLaMA, Qwen2 and Qwen3:
`model.embed_tokens`, `model.layers.N.{input_layernorm, self_attn, post_attention_layernorm,
mlp}`, `model.norm`, `lm_head` (absent when tied). The architectures differ only in options
of ModelArgs (engine/models/layers.py); each model file (llama.py, qwen.py) is a subclass
whose `from_config` sets them.

The forward pass takes one flattened ragged batch: `input_ids`/`positions` of T tokens from
any mix of sequences and a ForwardContext (engine/models/interface.py: the paged KV pool and
the step's AttentionMetadata). Q/K/V and gate/up projections are fused into one matmul each;
the checkpoint's names map onto them here (`load_weights`, `update_weights`), projection
biases and Qwen3's `q_norm`/`k_norm` included when the options have them.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from engine.models.config import ModelArgs
from engine.models.interface import CausalLMBase, ForwardContext
from engine.models.layers import Embedding, Linear, RMSNorm, TransformerBlock, rope_cache
from engine.weights import copy_weights


class DecoderLM(CausalLMBase):
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
    def from_config(cls, config: dict) -> "DecoderLM":
        """The model contract's constructor (engine/models/interface.py); parameters
        uninitialised."""
        return cls(ModelArgs.from_hf_config(config))

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """HF tensors by name, fused (q/k/v, gate/up) and assigned in one go; layers
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
        layer_no, part, proj, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if layer_no >= args.n_layers:
            return None
        layer = self.layers[layer_no]
        if part in ("input_layernorm", "post_attention_layernorm") and proj is None and kind == "weight":
            return getattr(layer, part).weight
        if part == "self_attn" and proj in ("q_norm", "k_norm") and kind == "weight" and args.qk_norm:
            return getattr(layer.self_attn, proj).weight
        q, kv, inter = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.intermediate_size
        rows = {("self_attn", "q_proj"): ("qkv_proj", 0, q), ("self_attn", "k_proj"): ("qkv_proj", q, kv),
                ("self_attn", "v_proj"): ("qkv_proj", q + kv, kv), ("self_attn", "o_proj"): ("o_proj", 0, None),
                ("mlp", "gate_proj"): ("gate_up_proj", 0, inter), ("mlp", "up_proj"): ("gate_up_proj", inter, inter),
                ("mlp", "down_proj"): ("down_proj", 0, None)}
        if (part, proj) not in rows:
            raise KeyError(name)
        param, start, length = rows[(part, proj)]
        tensor = getattr(getattr(layer.self_attn if part == "self_attn" else layer.mlp, param), kind)
        if tensor is None:  # a bias this architecture does not have
            raise KeyError(name)
        return tensor if length is None else tensor[start : start + length]


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp|input_layernorm|post_attention_layernorm)"
                       r"(?:\.(\w+))?\.(weight|bias)$")


def _fused_state_dict(hf: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """HF names -> this module's names (q/k/v and gate/up fused); the biases and q/k norms
    only where `args` has them."""
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
        if args.qkv_bias:
            out[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                [hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"]]
            )
        if args.o_bias:
            out[f"layers.{i}.self_attn.o_proj.bias"] = hf[attn + "o_proj.bias"]
        if args.qk_norm:
            out[f"layers.{i}.self_attn.q_norm.weight"] = hf[attn + "q_norm.weight"]
            out[f"layers.{i}.self_attn.k_norm.weight"] = hf[attn + "k_norm.weight"]
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]
        )
        out[f"layers.{i}.mlp.down_proj.weight"] = hf[mlp + "down_proj.weight"]
    return out
