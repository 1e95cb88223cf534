"""Weights in place: updates by checkpoint name (vLLM's `load_weights` contract).

`update_weights` takes (checkpoint name, tensor) pairs — any subset of the model's weights,
e.g. the policy an RL trainer just produced — or a safetensors file / directory. Where each
name lives is the model's business (`CausalLM.update_weights`; the built-in LLaMA maps HF
names onto its fused projections); `copy_weights` is the checked copy a model does it with."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch


def read_weights(path: str | Path) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a safetensors file or of every *.safetensors in a directory."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"update_weights: no safetensors weights at {path}")
    for f in files:
        yield from load_file(str(f)).items()


def copy_weights(
    target_of: Callable[[str], torch.Tensor | None], weights: Iterable[tuple[str, torch.Tensor]]
) -> int:
    """Copy each named tensor into `target_of(name)` (None: a weight the model skips, e.g. a
    layer past a truncated model's last; KeyError: not a weight of the model); returns how
    many were applied. Checks every name and shape first: a bad update changes nothing."""
    plan = []
    for name, tensor in weights:
        try:
            target = target_of(name)
        except KeyError:
            raise ValueError(f"update_weights: {name!r} is not a weight of this model") from None
        if target is None:
            continue
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model's "
                f"is {tuple(target.shape)}"
            )
        plan.append((target, tensor))
    with torch.no_grad():
        for target, tensor in plan:
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
    return len(plan)
