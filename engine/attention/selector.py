"""Which attention backend runs: Triton on CUDA, torch on CPU, or the one asked for."""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks triton on CUDA and torch elsewhere. `triton` on CPU needs
    TRITON_INTERPRET=1 set before Triton is imported (tests do this)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (torch, triton or auto)")
