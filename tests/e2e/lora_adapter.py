"""PEFT LoRA adapters for tests: random (non-zero) weights over the test model's first layers."""

from __future__ import annotations

from pathlib import Path


def make_adapter(model_dir: Path, out: Path, num_layers: int, rank: int = 8, seed: int = 0) -> Path:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for
    `model_dir` cut to `num_layers`, targeting q/v/o/down projections."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(
        str(model_dir), num_hidden_layers=num_layers, torch_dtype=torch.float32
    )
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        init_lora_weights=False,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.08)
    model.save_pretrained(str(out))
    return out
