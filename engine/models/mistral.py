"""Mistral: LLaMA's layout with an optional `sliding_window` on every layer (Mistral 7B
v0.1: 4096; later versions: none). Mixtral: Mistral with a sparse mixture of experts
(engine/models/moe.py) as every layer's MLP, checkpoint module `block_sparse_moe`; top-k
routing weights always re-normalised."""

from __future__ import annotations

from engine.models.config import ModelArgs, MoEArgs, hf_layer_types
from engine.models.decoder import DecoderLM


class MistralForCausalLM(DecoderLM):
    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        window = config.get("sliding_window")
        types = hf_layer_types(config, config["num_hidden_layers"], window)
        bias = bool(config.get("attention_bias", False))
        return ModelArgs.from_hf_config(
            config, qkv_bias=bias, o_bias=bias, layer_types=types, sliding_window=window
        )


class MixtralForCausalLM(DecoderLM):
    HF_ALIASES = {"block_sparse_moe": "mlp"}

    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        window = config.get("sliding_window")
        n = config["num_hidden_layers"]
        moe = MoEArgs(
            num_experts=config["num_local_experts"],
            top_k=config["num_experts_per_tok"],
            intermediate_size=config["intermediate_size"],
            renormalize=True,
            round_routing_weights=False,
            sparse_layers=frozenset(range(n)),
        )
        return ModelArgs.from_hf_config(
            config, layer_types=hf_layer_types(config, n, window), sliding_window=window, moe=moe
        )
