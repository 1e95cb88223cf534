"""Which attention backend runs: Triton on CUDA, torch on CPU, or the one asked for."""

from __future__ import annotations

from typing import Literal

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


def fused_kernels(backend_name: str, device: torch.device) -> Literal["triton", "cpu"] | None:
    """The fused layer kernels that go with a backend (a model's `use_fused_kernels`):
    "triton" with the Triton backend, "cpu" on the CPU where the C++ ops build (not with
    PDSERVE_CPU_KERNELS=0), else None (plain torch)."""
    from engine import cpu_kernels

    if backend_name == "triton":
        return "triton"
    return "cpu" if device.type == "cpu" and cpu_kernels.load() else None
