"""Gemma 2 and Gemma 3 (text): the HF decoder layout with Gemma's options.

Both: RMSNorm scaling by (1 + w) in fp32; "sandwich" norms (post-attention,
pre-feedforward, post-feedforward); embeddings multiplied by sqrt(hidden_size) in the model's
dtype; the softmax scale query_pre_attn_scalar ** -0.5; a GeGLU MLP (`gelu_pytorch_tanh`);
sliding-window and full-attention layers as `layer_types` says; logits soft-capped by
`final_logit_softcapping` when set; tied embeddings.
- Gemma 2: attention scores soft-capped by `attn_logit_softcapping`; every other layer
  slides (layers 0, 2, 4, ...) unless `layer_types` says otherwise.
- Gemma 3: per-head q/k RMSNorm; five sliding layers to one global (`sliding_window_pattern`
  6); sliding layers use their own RoPE base (`rope_local_base_freq`, 10 000).
"""

from __future__ import annotations

from typing import Any

from engine.models.config import FULL, SLIDING, ModelArgs, hf_layer_types
from engine.models.decoder import DecoderLM
from engine.models.rope import RopeSpec


def _gemma_options(config: dict, default_sliding) -> dict[str, Any]:
    window = config.get("sliding_window")
    return dict(
        layer_types=hf_layer_types(config, config["num_hidden_layers"], window, default_sliding),
        sliding_window=window,
        attn_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_softcap=config.get("final_logit_softcapping"),
        norm_unit_offset=True,
        norm_layout="sandwich",
        embed_scale=float(config["hidden_size"]) ** 0.5,
        qkv_bias=bool(config.get("attention_bias", False)),
        o_bias=bool(config.get("attention_bias", False)),
        tie_word_embeddings=config.get("tie_word_embeddings", True),
    )


class Gemma2ForCausalLM(DecoderLM):
    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        options = _gemma_options(config, lambda i: (i + 1) % 2 == 1)
        return ModelArgs.from_hf_config(
            config, attn_softcap=config.get("attn_logit_softcapping"), **options
        )


class Gemma3ForCausalLM(DecoderLM):
    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        pattern = config.get("sliding_window_pattern", 6)
        options = _gemma_options(config, lambda i: (i + 1) % pattern != 0)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rope = config.get("rope_parameters") or {}
        if SLIDING in rope:  # transformers >= 5: one dict per layer type
            full = RopeSpec.from_hf_config(config, head_dim=head_dim, params=rope[FULL])
            local = RopeSpec.from_hf_config(config, head_dim=head_dim, params=rope[SLIDING])
        else:  # older configs: rope_theta (+ rope_scaling) global, rope_local_base_freq local
            full = RopeSpec.from_hf_config(
                config, head_dim=head_dim, theta=config.get("rope_theta", 1e6)
            )
            local = RopeSpec.from_hf_config(
                config, head_dim=head_dim, params={}, theta=config.get("rope_local_base_freq", 1e4)
            )
        return ModelArgs.from_hf_config(
            config,
            qk_norm=True,
            attn_softcap=config.get("attn_logit_softcapping"),
            rope=full,
            local_rope=local,
            **options,
        )
