"""Attention through the Triton kernels (CUDA; or CPU under TRITON_INTERPRET=1 in tests)."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """store_kv + one ragged paged-attention launch per layer; the launch plans are made once
    per step (the metadata object) and per sliding window, and shared by every layer."""

    name = "triton"

    def __init__(self) -> None:
        import kernels  # imported here: Triton reads TRITON_INTERPRET at import time

        self._k = kernels
        self._planned: tuple[AttentionMetadata, dict[int | None, object]] | None = None

    def _plan(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        sliding_window: int | None,
    ):
        if self._planned is None or self._planned[0] is not metadata:
            self._planned = (metadata, {})
        plans = self._planned[1]
        if sliding_window not in plans:  # split-KV partitions cover the window, not the context
            plans[sliding_window] = self._k.plan_paged_attention(
                query.device,
                query.shape[0],
                metadata.num_seqs,
                query.shape[1],
                kv_cache.shape[1],
                kv_cache.shape[5],
                metadata.max_query_len,
                metadata.max_seq_len,
                sliding_window=sliding_window,
                kv_dtype=kv_cache.dtype,
            )
        return plans[sliding_window]

    def forward(
        self,
        query,
        key,
        value,
        kv_cache,
        layer,
        metadata: AttentionMetadata,
        scale,
        *,
        sliding_window=None,
        logits_soft_cap=None,
    ):
        self._k.store_kv(key, value, kv_cache, layer, metadata.slot_mapping)
        return self._k.paged_attention(
            query,
            kv_cache,
            layer,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            scale,
            metadata.max_query_len,
            metadata.max_seq_len,
            plan=self._plan(query, kv_cache, metadata, sliding_window),
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
