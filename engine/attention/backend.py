"""The attention backend interface the model calls once per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Stores a step's new K/V into the paged pool, then attends over the pool.

    Contract: `kv_cache` is `[num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]`
    (index 0 = K, 1 = V; `num_layers`: the layers one block holds — a KV group's, and then
    `layer` is the slot in the group's blocks and `metadata` the group's, engine/kv/kv_groups.py).
    `forward` first writes `key`/`value` (`[T, num_kv_heads, head_dim]`)
    to `metadata.slot_mapping` of `layer`, then returns `[T, num_q_heads, head_dim]`: each query
    attends causally (see AttentionMetadata) with GQA (q head h reads kv head
    h // (num_q_heads // num_kv_heads)) and softmax scale `scale`.

    Per-layer options (None = off, the plain causal attention above):
    - sliding_window W: the query at position p attends to keys j with p - W < j <= p (at most
      W keys, itself included; transformers' sliding-window causal mask). A backend never reads
      a key before seq_len - query_len - W + 1 (the first key any query of the sequence sees)
      nor the block-table entries of blocks wholly before it: the block manager may have
      released those blocks, so their entries can be stale.
    - logits_soft_cap c: scores = c * tanh(q.k * scale / c), before the mask and the softmax
      (Gemma 2's attn_logit_softcapping).
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
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor: ...
