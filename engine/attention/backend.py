"""The attention backend interface the model calls once per layer."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Stores a step's new K/V into the paged pool, then attends over the pool.

    Contract: `kv_cache` is `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`
    (index 0 = K, 1 = V). `forward` first writes `key`/`value` (`[T, num_kv_heads, head_dim]`)
    to `metadata.slot_mapping` of `layer`, then returns `[T, num_q_heads, head_dim]`: each query
    attends causally (see AttentionMetadata) with GQA (q head h reads kv head
    h // (num_q_heads // num_kv_heads)) and softmax scale `scale`.
    """

    name: str

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
