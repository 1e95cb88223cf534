"""Write a small random TinyForCausalLM checkpoint directory:

config.json          architectures ["TinyForCausalLM"], this architecture's own keys
model.safetensors    tensors under this architecture's own names (blocks.{i}.attn.wq, ...)
tokenizer*.json, generation_config.json   copied from pdserve's bundled default model

python -m tiny_arch.make_checkpoint OUT_DIR [--layers N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def tiny_config(vocab_size: int, layers: int = 2) -> dict:
    return {
        "architectures": ["TinyForCausalLM"],
        "model_type": "tiny",
        "vocab_size": vocab_size,
        "num_hidden_layers": layers,
        "d_model": 64,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 128,
        "norm_eps": 1e-5,
        "rope_base": 10000.0,
        "max_position_embeddings": 1024,
        "torch_dtype": "float32",
    }


def make_checkpoint(
    out_dir: Path, layers: int = 2, seed: int = 0, tokenizer_dir: Path | None = None
) -> Path:
    """Random weights (scaled so the logits have a clear argmax) + the bundled tokenizer."""
    from safetensors.torch import save_file

    from tiny_arch.model import TinyForCausalLM

    if tokenizer_dir is None:
        from engine.models.prepare import default_model_dir

        tokenizer_dir = default_model_dir()
    vocab = json.loads((Path(tokenizer_dir) / "config.json").read_text())["vocab_size"]
    config = tiny_config(vocab, layers)
    shapes = TinyForCausalLM.from_config(config).named_parameters()
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, p in shapes:
        if (
            name.endswith("norm_in.weight")
            or name.endswith("norm_ffn.weight")
            or name == "norm_out.weight"
        ):
            weights[name] = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name == "embed.weight":
            weights[name] = torch.randn(p.shape, generator=gen)
        else:  # Linear [out, in]
            weights[name] = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out_dir", type=Path)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(make_checkpoint(a.out_dir, a.layers, a.seed))


if __name__ == "__main__":
    main()
