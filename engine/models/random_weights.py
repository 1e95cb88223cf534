"""A model directory with another model's config and tokenizer and weights drawn at random.

For the places real weights cannot reach: the GPU check (tools/gpu/gpu_check.sh) runs on a
machine with no network and carries at most 64 MiB, while SmolLM2-135M is 540 MB in fp32.
Speed, memory, KV transfer and kernel-vs-reference parity depend on the shapes, not on the
values, so a checkpoint of the right shape drawn from a seed serves them; generated text is
noise. Greedy parity holds on such weights too: with the default std (HF's
`initializer_range`, 0.02) the top two logits of a step are typically ~0.1 apart, far above
fp32 rounding differences between kernels.

    python -m engine.models.random_weights OUT [--source DIR] [--seed 0] [--num-layers N]

The output loads like any HF LLaMA directory (ours and transformers'): the same seed gives
the same bytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def llama_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF LLaMA tensor names -> shapes, for `config` (a config.json)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = (
        config["num_attention_heads"],
        config.get("num_key_value_heads") or config["num_attention_heads"],
    )
    head_dim = config.get("head_dim") or hidden // heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    return shapes


def random_state_dict(
    config: dict, seed: int = 0, std: float | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Matrices ~ N(0, std^2) (std: the config's initializer_range, else 0.02); norm weights
    ~ 1 + N(0, 0.1^2), so every layer's output depends on them. Drawn on the CPU in a fixed
    order from one generator: the same seed gives the same tensors on any machine."""
    std = std if std is not None else float(config.get("initializer_range", 0.02))
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in llama_weight_shapes(config).items():
        values = torch.randn(shape, generator=gen)
        state[name] = (1.0 + 0.1 * values if name.endswith("norm.weight") else std * values).to(
            dtype
        )
    return state


def write_random_model(
    source: Path,
    out_dir: Path,
    seed: int = 0,
    num_layers: int | None = None,
    std: float | None = None,
    dtype: str = "float32",
) -> Path:
    """`source`'s config.json and tokenizer files, random weights, into `out_dir` (replaced)."""
    from safetensors.torch import save_file

    config = json.loads((source / "config.json").read_text())
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    config["torch_dtype"] = dtype
    state = random_state_dict(config, seed, std, getattr(torch, dtype))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out_dir / name)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", type=Path, help="directory to write (replaced if it exists)")
    ap.add_argument(
        "--source",
        default="default",
        help="directory with config.json and the tokenizer files (default: the bundled model)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--num-layers", type=int, default=None, help="keep the source's layer count unless set"
    )
    ap.add_argument(
        "--std", type=float, default=None, help="default: the config's initializer_range, else 0.02"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    from engine.models.prepare import resolve_model_path

    out = write_random_model(
        resolve_model_path(args.source), args.out, args.seed, args.num_layers, args.std, args.dtype
    )
    print(out)


if __name__ == "__main__":
    main()
