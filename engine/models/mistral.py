"""Mistral: LLaMA's layout with an optional `sliding_window` on every layer (Mistral 7B
v0.1: 4096; later versions: none)."""
from __future__ import annotations

from engine.models.config import ModelArgs, hf_layer_types
from engine.models.decoder import DecoderLM


class MistralForCausalLM(DecoderLM):
    @classmethod
    def from_config(cls, config: dict) -> "MistralForCausalLM":
        window = config.get("sliding_window")
        types = hf_layer_types(config, config["num_hidden_layers"], window)
        bias = bool(config.get("attention_bias", False))
        return cls(ModelArgs.from_hf_config(config, qkv_bias=bias, o_bias=bias, layer_types=types,
                                            sliding_window=window))
