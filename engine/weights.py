"""Weights in place: updates by HF name (vLLM's `load_weights` contract), and sleep / wake.

`update_weights` takes (HF name, tensor) pairs — any subset of the model's weights, e.g. the
policy an RL trainer just produced — or a safetensors file / directory, and copies each into
the parameter (or the row range of a fused parameter: q/k/v share `qkv_proj`, gate/up share
`gate_up_proj`) that holds it. Shapes must match; an unknown name is an error before anything
is copied."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import torch

from engine.models.config import ModelArgs
from engine.models.llama import Transformer

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp|input_layernorm|post_attention_layernorm)"
                    r"(?:\.(\w+))?\.weight$")


def _target(model: Transformer, args: ModelArgs, name: str) -> torch.Tensor | None:
    """The tensor (a row range of a fused one) that HF weight `name` lives in; None for a
    layer this (truncated) model does not have."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight
    if name == "model.norm.weight":
        return model.norm.weight
    if name == "lm_head.weight":
        return model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(name)
    layer_no, part, proj = int(m.group(1)), m.group(2), m.group(3)
    if layer_no >= args.n_layers:
        return None
    layer = model.layers[layer_no]
    if part in ("input_layernorm", "post_attention_layernorm") and proj is None:
        return getattr(layer, part).weight
    q, kv, inter = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.intermediate_size
    rows = {("self_attn", "q_proj"): ("qkv_proj", 0, q), ("self_attn", "k_proj"): ("qkv_proj", q, kv),
            ("self_attn", "v_proj"): ("qkv_proj", q + kv, kv), ("self_attn", "o_proj"): ("o_proj", 0, None),
            ("mlp", "gate_proj"): ("gate_up_proj", 0, inter), ("mlp", "up_proj"): ("gate_up_proj", inter, inter),
            ("mlp", "down_proj"): ("down_proj", 0, None)}
    if (part, proj) not in rows:
        raise KeyError(name)
    param, start, length = rows[(part, proj)]
    weight = getattr(layer.self_attn if part == "self_attn" else layer.mlp, param).weight
    return weight if length is None else weight[start : start + length]


def read_weights(path: str | Path) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a safetensors file or of every *.safetensors in a directory."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"update_weights: no safetensors weights at {path}")
    for f in files:
        yield from load_file(str(f)).items()


def apply_weights(model: Transformer, args: ModelArgs,
                  weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy HF-named weights into `model`; returns how many were applied. Checks every name
    and shape first: a bad update changes nothing."""
    plan = []
    for name, tensor in weights:
        try:
            target = _target(model, args, name)
        except KeyError:
            raise ValueError(f"update_weights: {name!r} is not a weight of this model") from None
        if target is None:
            continue
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model's "
                             f"is {tuple(target.shape)}")
        plan.append((target, tensor))
    with torch.no_grad():
        for target, tensor in plan:
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
    return len(plan)
