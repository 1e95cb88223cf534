"""Qwen2 and Qwen3: the HF decoder layout of engine/models/decoder.py with their options.

- Qwen2: biases on q/k/v (none on o_proj), whatever the config says.
- Qwen3: RMSNorm over head_dim on each q and k head before RoPE (`q_norm`, `k_norm`); q/k/v
  and o biases only with `attention_bias`; an explicit `head_dim` that may differ from
  hidden_size // num_attention_heads.
- Qwen3-MoE: Qwen3 with a sparse mixture of experts (engine/models/moe.py) as the MLP of
  every `decoder_sparse_step`-th layer not in `mlp_only_layers`; routing weights re-normalised
  with `norm_topk_prob`.
- All: with `use_sliding_window`, layers from `max_window_layers` on attend within
  `sliding_window` (or as the config's `layer_types` says).
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelArgs, MoEArgs, hf_layer_types
from engine.models.decoder import DecoderLM


def qwen_windows(config: dict) -> dict[str, Any]:
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    first = config.get("max_window_layers", 0)
    types = hf_layer_types(config, config["num_hidden_layers"], window, lambda i: i >= first)
    return {"layer_types": types, "sliding_window": window}


class Qwen2ForCausalLM(DecoderLM):
    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        return ModelArgs.from_hf_config(config, qkv_bias=True, o_bias=False, **qwen_windows(config))


class Qwen3ForCausalLM(DecoderLM):
    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        bias = bool(config.get("attention_bias", False))
        return ModelArgs.from_hf_config(
            config, qkv_bias=bias, o_bias=bias, qk_norm=True, **qwen_windows(config)
        )


class Qwen3MoeForCausalLM(DecoderLM):
    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        bias = bool(config.get("attention_bias", False))
        step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
        experts = config.get(
            "num_experts", config.get("num_local_experts", 0)
        )  # transformers 5 writes the latter
        sparse = frozenset(
            i
            for i in range(config["num_hidden_layers"])
            if experts > 0 and step > 0 and (i + 1) % step == 0 and i not in dense
        )
        moe = MoEArgs(
            num_experts=experts,
            top_k=config["num_experts_per_tok"],
            intermediate_size=config["moe_intermediate_size"],
            renormalize=bool(config.get("norm_topk_prob", False)),
            round_routing_weights=True,
            sparse_layers=sparse,
        )
        return ModelArgs.from_hf_config(
            config, qkv_bias=bias, o_bias=bias, qk_norm=True, moe=moe, **qwen_windows(config)
        )
