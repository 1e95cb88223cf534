"""Granite: LLaMA's layout with four multipliers — embeddings times `embedding_multiplier`,
the softmax scale `attention_multiplier`, each block's attention and MLP outputs times
`residual_multiplier`, logits divided by `logits_scaling`."""

from __future__ import annotations

from engine.models.config import ModelArgs
from engine.models.decoder import DecoderLM


class GraniteForCausalLM(DecoderLM):
    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        bias = bool(config.get("attention_bias", False))
        return ModelArgs.from_hf_config(
            config,
            qkv_bias=bias,
            o_bias=bias,
            embed_scale=float(config.get("embedding_multiplier", 1.0)),
            attn_scale=float(config.get("attention_multiplier", 1.0)),
            residual_scale=float(config.get("residual_multiplier", 1.0)),
            logits_divisor=float(config.get("logits_scaling", 1.0)),
        )
