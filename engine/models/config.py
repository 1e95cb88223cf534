"""Model hyper-parameters read from an HF `config.json` (the LLaMA, Qwen2 and Qwen3 layouts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The built-in architectures and the `model_type` their configs carry.
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    """The config's `head_dim` when given (Qwen3: not dim // n_heads), else dim // n_heads."""
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2 always; LLaMA and Qwen3 with `attention_bias`)."""
    o_bias: bool = False
    """A bias on o_proj (LLaMA and Qwen3 with `attention_bias`; never Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on each q and k head, before RoPE (Qwen3)."""

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], **options: bool) -> "ModelArgs":
        """The fields every built-in architecture shares; `options` (qkv_bias, o_bias, qk_norm)
        come from the model class that knows its architecture. ValueError for what the built-in
        layers cannot run."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        model_type = cfg.get("model_type", "llama")
        if HF_ARCHITECTURES.get(archs[0]) != model_type:
            raise ValueError(f"unsupported architecture {archs} with model_type {model_type!r} "
                             f"(built in: {', '.join(HF_ARCHITECTURES)})")
        if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or ()):
            raise ValueError(f"{archs[0]}: use_sliding_window (sliding-window attention) is not "
                             "supported yet")
        if cfg.get("mlp_bias"):
            raise ValueError(f"{archs[0]}: mlp_bias is not supported")
        rope = cfg.get("rope_parameters") or {}  # transformers >= 5 writes rope_theta in here
        if cfg.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_scaling {cfg.get('rope_scaling') or rope!r} is not supported yet")
        n_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            **options,
        )
