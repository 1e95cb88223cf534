"""Qwen2 and Qwen3: the HF decoder layout of engine/models/decoder.py with their options.

- Qwen2: biases on q/k/v (none on o_proj), whatever the config says.
- Qwen3: RMSNorm over head_dim on each q and k head before RoPE (`q_norm`, `k_norm`); q/k/v
  and o biases only with `attention_bias`; an explicit `head_dim` that may differ from
  hidden_size // num_attention_heads.

Sliding-window attention (`use_sliding_window`) is refused by ModelArgs.from_hf_config.
"""
from __future__ import annotations

from engine.models.config import ModelArgs
from engine.models.decoder import DecoderLM


class Qwen2ForCausalLM(DecoderLM):
    @classmethod
    def from_config(cls, config: dict) -> "Qwen2ForCausalLM":
        return cls(ModelArgs.from_hf_config(config, qkv_bias=True, o_bias=False))


class Qwen3ForCausalLM(DecoderLM):
    @classmethod
    def from_config(cls, config: dict) -> "Qwen3ForCausalLM":
        bias = bool(config.get("attention_bias", False))
        return cls(ModelArgs.from_hf_config(config, qkv_bias=bias, o_bias=bias, qk_norm=True))
