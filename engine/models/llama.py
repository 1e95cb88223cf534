"""LLaMA (RMSNorm, RoPE, SwiGLU, GQA, optional tied embeddings): the HF decoder layout of
engine/models/decoder.py with no options beyond `attention_bias` (biases on q/k/v and o)."""

from __future__ import annotations

from engine.models.config import ModelArgs
from engine.models.decoder import DecoderLM


class Transformer(DecoderLM):
    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        """The model contract's constructor (engine/models/interface.py); parameters
        uninitialised."""
        bias = bool(config.get("attention_bias", False))
        return ModelArgs.from_hf_config(config, qkv_bias=bias, o_bias=bias)
