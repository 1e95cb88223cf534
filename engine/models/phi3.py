"""Phi-3: LLaMA's math with fused checkpoint tensors (`self_attn.qkv_proj`,
`mlp.gate_up_proj` — the engine's own fused layout, loaded as they are) and an optional
`sliding_window` on every layer."""

from __future__ import annotations

from engine.models.config import ModelArgs, hf_layer_types
from engine.models.decoder import DecoderLM


class Phi3ForCausalLM(DecoderLM):
    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        window = config.get("sliding_window")
        types = hf_layer_types(config, config["num_hidden_layers"], window)
        return ModelArgs.from_hf_config(config, layer_types=types, sliding_window=window)
