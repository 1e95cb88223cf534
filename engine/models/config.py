"""Model hyper-parameters read from an HF `config.json` (LLaMA architecture)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if cfg.get("model_type", "llama") != "llama" or "LlamaForCausalLM" not in archs:
            raise ValueError(f"unsupported architecture {archs} (only LlamaForCausalLM)")
        if cfg.get("rope_scaling"):
            raise ValueError(f"rope_scaling {cfg['rope_scaling']!r} is not supported yet")
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
            rope_theta=cfg.get("rope_theta", 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        )
