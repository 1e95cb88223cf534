"""OLMo 2: LLaMA's math with its norms after each branch (`post_attention_layernorm` on the
attention output, `post_feedforward_layernorm` on the MLP output, none on their inputs) and
one RMSNorm over all of q's heads (and all of k's) before RoPE."""

from __future__ import annotations

from engine.models.config import ModelArgs
from engine.models.decoder import DecoderLM


class Olmo2ForCausalLM(DecoderLM):
    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        bias = bool(config.get("attention_bias", False))
        return ModelArgs.from_hf_config(
            config, qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_whole=True, norm_layout="post"
        )
