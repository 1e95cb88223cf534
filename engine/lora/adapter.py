"""A PEFT LoRA adapter read from disk and checked against the base model.

PEFT's layout: adapter_config.json (`r`, `lora_alpha`, `target_modules`, `use_rslora`) and
adapter_model.safetensors with `...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight` [r, in]
and `...lora_B.weight` [out, r]. The delta a target adds is scale * B (A x), scale =
lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.lora.request import LoRARequest
from engine.models.config import ModelArgs

MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", *MLP_TARGETS)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be used: missing, malformed, or not fitting the base model."""


def target_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection LoRA may target."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {
        "q_proj": (args.dim, q),
        "k_proj": (args.dim, kv),
        "v_proj": (args.dim, kv),
        "o_proj": (q, args.dim),
        "gate_proj": (args.dim, args.intermediate_size),
        "up_proj": (args.dim, args.intermediate_size),
        "down_proj": (args.intermediate_size, args.dim),
    }


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    request: LoRARequest
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    """(layer, target) -> (A [rank, in], B [out, rank]) in fp32 on the CPU."""

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id


def load_adapter(request: LoRARequest, args: ModelArgs, max_rank: int) -> LoRAAdapter:
    path = Path(request.lora_path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise LoRAError(
            f"LoRA adapter {request.lora_name!r}: {path} needs adapter_config.json "
            "and adapter_model.safetensors"
        )
    try:
        config = json.loads(config_file.read_text())
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (ValueError, KeyError, TypeError) as e:
        raise LoRAError(
            f"LoRA adapter {request.lora_name!r}: adapter_config.json is not a LoRA config ({e})"
        ) from None
    if not 1 <= rank <= max_rank:
        raise LoRAError(
            f"LoRA adapter {request.lora_name!r}: rank {rank} is above max_lora_rank {max_rank}"
            if rank > max_rank
            else f"rank must be >= 1, got {rank}"
        )
    from safetensors.torch import load_file

    tensors = load_file(str(weights_file))
    shapes = target_shapes(args)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r}: weight {key!r} is not a LoRA "
                f"weight of {', '.join(TARGETS)}"
            )
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= args.n_layers:
            continue  # the base model was loaded with fewer layers (tests): not needed
        if args.moe is not None and layer in args.moe.sparse_layers and target in MLP_TARGETS:
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r}: layer {layer} {target}: the "
                "layer's MLP is a mixture of experts, and LoRA on experts is not "
                "supported"
            )
        parts.setdefault((layer, target), {})[ab] = tensor.float()
    weights = {}
    for (layer, target), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r}: layer {layer} {target} lacks "
                f"lora_{'B' if 'A' in ab else 'A'}"
            )
        a, b = ab["A"], ab["B"]
        n_in, n_out = shapes[target]
        if a.shape != (rank, n_in) or b.shape != (n_out, rank):
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r}: layer {layer} {target} has "
                f"A {tuple(a.shape)}, B {tuple(b.shape)}; the base model needs "
                f"A ({rank}, {n_in}), B ({n_out}, {rank})"
            )
        weights[(layer, target)] = (a.contiguous(), b.contiguous())
    if not weights:
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: no LoRA weights in {weights_file}")
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return LoRAAdapter(request, rank, scale, weights)
