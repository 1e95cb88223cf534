"""Tiny random float32 checkpoints for the tensor-parallel tests, built with transformers' own
classes (the builders of tests/models/test_arch_parity.py), written once per test session."""

from __future__ import annotations

from pathlib import Path

from tests.models.test_arch_parity import ARCHS, COMMON, write_checkpoint


def _llama_kv1():
    """One KV head (MQA): at tp=2 it is replicated on both ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            **{**COMMON, "num_key_value_heads": 1},
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )
    )


def _llama_uneven():
    """The default model's head shape in small: 9 query heads over 3 KV heads (6+3 at tp=2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            **{
                **COMMON,
                "hidden_size": 72,
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "intermediate_size": 96,
            },
            tie_word_embeddings=True,
        )
    )


BUILDERS = {name: build for name, (build, _) in ARCHS.items()}
BUILDERS["llama-kv1"] = _llama_kv1
BUILDERS["llama-9q3kv"] = _llama_uneven


def write_tiny(name: str, model_dir: Path, out: Path) -> Path:
    """Checkpoint `name` (a key of BUILDERS) written to `out` with the bundled tokenizer."""
    import torch

    torch.manual_seed(0)
    hf = BUILDERS[name]().eval()
    out.mkdir(parents=True, exist_ok=True)
    return write_checkpoint(hf, model_dir, out)
