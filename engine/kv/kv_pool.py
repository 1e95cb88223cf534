"""Sizing and allocating the KV pool: one tensor, block-major, so one block (all layers, K and
V) is one contiguous region — one descriptor for a KV transfer.

Inside a block the kv heads come first ("HND" at the block level): one kv head's rows of all
the block's layers, K and V, are one contiguous region too, so a range of heads of a block —
what a worker at another tensor-parallel size holds of it (kvtransfer/heads.py) — is one
region, not one piece per (layer, K/V, token) row."""

from __future__ import annotations

import torch

from engine.config import EngineConfig, GiB
from engine.kv import kv_format
from engine.models.config import ModelArgs

DEFAULT_CPU_KV_MEMORY = 2 * GiB


def kv_block_shape(
    args: ModelArgs, block_size: int, kv_cache_dtype: str = "auto"
) -> tuple[int, ...]:
    """One block: [kv heads, layers of a KV group, K/V, tokens, stored head dim] (all the
    layers when they attend alike, engine/kv/kv_groups.py; head_dim + 4 for int8: the per-token
    scales live in the block, engine/kv/kv_format.py). Heads first: a head of a block is one
    contiguous region (the module docstring)."""
    return (
        args.n_kv_heads,
        args.kv_groups().group_size,
        2,
        block_size,
        kv_format.stored_head_dim(kv_cache_dtype, args.head_dim),
    )


def kv_block_bytes(
    args: ModelArgs, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes of one block; `dtype` is the model's (what `auto` stores)."""
    n = 1
    for d in kv_block_shape(args, block_size, kv_cache_dtype):
        n *= d
    storage = kv_format.storage_dtype(kv_cache_dtype, dtype)
    return n * torch.tensor([], dtype=storage).element_size()


def num_blocks_for_budget(
    config: EngineConfig,
    args: ModelArgs,
    dtype: torch.dtype,
    device: torch.device,
    profile_peak_bytes: int | None = None,
) -> int:
    """Blocks that fit `kv_cache_memory`; on CUDA without it, what is left of
    `gpu_memory_utilization` x total memory after the profiled peak of a forward."""
    block_bytes = kv_block_bytes(args, config.block_size, dtype, config.kv_cache_dtype)
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * config.gpu_memory_utilization) - (profile_peak_bytes or 0)
    else:
        budget = DEFAULT_CPU_KV_MEMORY
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no {block_bytes}-byte block: raise "
            "--kv-cache-memory or --gpu-memory-utilization"
        )
    return num_blocks


def allocate_kv_pool(
    num_blocks: int,
    args: ModelArgs,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """[num_blocks, num_kv_heads, layers per block (engine/kv/kv_groups.py), 2, block_size,
    stored head_dim], zero-filled. On CPU
    the pool asks for transparent huge pages before its pages are first touched: KV
    transfers (NIXL/CMA pins the receiver's pages) run about twice as fast on them."""
    pool = torch.empty(
        (num_blocks, *kv_block_shape(args, block_size, kv_cache_dtype)),
        dtype=kv_format.storage_dtype(kv_cache_dtype, dtype),
        device=device,
    )
    if pool.device.type == "cpu":
        advise_huge_pages(pool)
    return pool.zero_()


def advise_huge_pages(t: torch.Tensor) -> None:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned interior of `t` (best effort: Linux
    with THP in `madvise` or `always` mode; silently nothing elsewhere)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    huge, madv_hugepage = 2 << 20, 14
    start = (t.data_ptr() + huge - 1) & ~(huge - 1)
    end = (t.data_ptr() + t.numel() * t.element_size()) & ~(huge - 1)
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), madv_hugepage)


def profile_peak(
    model,
    backend,
    config: EngineConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Peak CUDA memory of a forward over a full token budget (weights included, the
    temporary pool not)."""
    from engine.attention import AttentionMetadata
    from engine.models.interface import ForwardContext

    args, bs = model.args, config.block_size
    n = min(config.max_num_batched_tokens, max_model_len)
    blocks, groups = -(-n // bs), args.kv_groups().num_groups
    pool = allocate_kv_pool(blocks * groups, args, bs, dtype, device, config.kv_cache_dtype)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        model(
            torch.zeros(n, dtype=torch.long, device=device),
            torch.arange(n, device=device),
            ForwardContext.for_groups(
                backend,
                pool,
                AttentionMetadata.single_sequence_groups(0, n, bs, blocks, groups, device),
            ),
            # A full decode step samples max_num_seqs rows: their logits are part of the peak.
            logits_indices=torch.arange(n - min(n, config.max_num_seqs), n, device=device),
        )
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - pool.numel() * pool.element_size()
    del pool
    torch.cuda.empty_cache()
    return peak
