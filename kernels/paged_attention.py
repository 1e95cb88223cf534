"""Paged causal attention over the KV pool for a ragged prefill/decode batch.

Contract shared by `paged_attention` (Triton) and `paged_attention_reference` (torch):
- query [T, num_q_heads, head_dim]: the step's queries, sequence after sequence.
- kv_cache [num_blocks, num_kv_heads, num_layers, 2, block_size, D_stored]: the pool, which
  already holds every key/value of this step (`store_kv` runs first), in the model dtype
  (D_stored = head_dim) or quantized (fp8 e4m3/e5m2: D_stored = head_dim; int8: head_dim + 4;
  kernels/kv_quant.py). Quantized K/V are dequantized on the fly.
- block_tables [S, max_blocks_per_seq]: sequence s's position j lives in block
  block_tables[s, j // block_size] at offset j % block_size. Entries past the sequence's last
  block are never read (any value). Blocks may be shared between sequences (prefix hits).
- query_start_loc [S+1]: cumulative query counts (query_start_loc[S] == T).
- seq_lens [S]: context length of each sequence INCLUDING this step's queries. Sequence s's
  q_len queries sit at positions seq_lens[s] - q_len .. seq_lens[s] - 1 and each attends to
  keys 0 .. its own position.
- sliding_window W (None = off; transformers' sliding-window causal mask): the query at
  position p attends to keys j with p - W < j <= p, i.e. to at most W keys, itself included.
  Keys before seq_lens[s] - q_len - W + 1 (the first key any query of the sequence sees) are
  never read, nor are the block-table entries of blocks that lie wholly before it: those
  blocks may already be released and their entries stale.
- logits_soft_cap c (None = off; Gemma 2): scores = c * tanh(q.k * scale / c), applied before
  the mask and the softmax.
- GQA: query head h reads kv head h // (num_q_heads // num_kv_heads).
Returns [T, num_q_heads, head_dim] in query's dtype (the model dtype, also for a quantized pool);
softmax statistics are fp32.
"""

import functools
from dataclasses import dataclass

import torch
import triton

from kernels._checks import FLOAT_DTYPES, check, check_kv_cache
from kernels.kv_quant import (
    dequantize_kv_reference,
    format_code,
    kernel_view,
    kv_format,
    pool_head_dim,
)
from kernels.merge_partitions import merge_partitions
from kernels.paged_attention_kernel import paged_attention_kernel

LOG2E = 1.4426950408889634
# Running under the Triton interpreter (TRITON_INTERPRET=1 when triton was imported).
_INTERPRETED = type(paged_attention_kernel).__name__ == "InterpretedFunction"
# Split-KV heuristic (GPU): aim for this many programs per SM, never cut a context into
# partitions shorter than MIN_PARTITION_SIZE tokens or into more than MAX_PARTITIONS pieces.
PROGRAMS_PER_SM = 4
MIN_PARTITION_SIZE = 256
MAX_PARTITIONS = 64


def _check_args(query, kv_cache, layer, block_tables, query_start_loc, seq_lens) -> None:
    check_kv_cache(kv_cache, layer)
    _, num_kv_heads, _, _, _, d_stored = kv_cache.shape
    fmt, head_dim = kv_format(kv_cache), pool_head_dim(kv_cache)
    check(
        query.dim() == 3 and query.shape[2] == head_dim,
        f"query must be [T, num_q_heads, {head_dim}] to match kv_cache (format {fmt}, "
        f"last dim {d_stored}), got {tuple(query.shape)}",
    )
    check(
        query.shape[1] % num_kv_heads == 0,
        f"num_q_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}",
    )
    if fmt == "auto":
        check(
            query.dtype == kv_cache.dtype,
            f"query dtype {query.dtype} != kv_cache dtype {kv_cache.dtype}",
        )
    else:
        check(query.dtype in FLOAT_DTYPES, f"query dtype {query.dtype} not in {FLOAT_DTYPES}")
    check(query.stride(2) == 1, f"query must have a contiguous last dim, strides {query.stride()}")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check(seq_lens.dim() == 1, f"seq_lens must be [S], got {tuple(seq_lens.shape)}")
    check(
        query_start_loc.dim() == 1 and query_start_loc.shape[0] == num_seqs + 1,
        f"query_start_loc must be [S+1={num_seqs + 1}], got {tuple(query_start_loc.shape)}",
    )
    check(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
        f"block_tables must be [S={num_seqs}, max_blocks], got {tuple(block_tables.shape)}",
    )
    check(
        block_tables.stride(1) == 1,
        f"block_tables rows must be contiguous, strides {block_tables.stride()}",
    )
    for name, x in (
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
    ):
        check(x.dtype in (torch.int32, torch.int64), f"{name} must be int32/int64, got {x.dtype}")
        check(
            x.device == kv_cache.device, f"{name} is on {x.device}, kv_cache on {kv_cache.device}"
        )
        check(x.dim() == 2 or x.is_contiguous(), f"{name} must be contiguous, strides {x.stride()}")
    check(
        query.device == kv_cache.device,
        f"query is on {query.device}, kv_cache on {kv_cache.device}",
    )


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _auto_partition_size(
    device: torch.device, num_programs: int, max_seq_len: int, tile_n: int
) -> int:
    """0 (no split) unless the batch leaves the GPU under-occupied and contexts are long. GPU
    time on an H200, SmolLM2 shapes, from a CUDA graph (what decode steps replay): 64 x 2k
    0.060 ms unsplit, 0.041-0.043 in 2-8 parts; 64 x 4k 0.114 vs 0.069-0.076; 256 x 1k
    (768 programs) 0.062 unsplit vs 0.070 in 2. Launched eagerly, the merge's extra launch
    costs the host more than the split saves the GPU, but eager steps are host-bound anyway."""
    if device.type != "cuda":
        return 0
    target = PROGRAMS_PER_SM * _num_sms(device)
    if num_programs >= target:
        return 0
    parts = min(
        triton.cdiv(target, num_programs), max_seq_len // MIN_PARTITION_SIZE, MAX_PARTITIONS
    )
    if parts < 2:
        return 0
    return triton.cdiv(triton.cdiv(max_seq_len, parts), tile_n) * tile_n


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How `paged_attention` cuts one batch into programs (see paged_attention_kernel's doc).
    Depends only on host-side sizes, so the model runner can make it once per step and pass it
    to every layer."""

    group_pad: int  # query heads per kv head, padded to a power of two
    block_q: int  # query tokens per tile
    block_m: int  # rows per tile = block_q * group_pad (>= 16 for tl.dot)
    tile_n: int  # keys per inner-loop step
    num_tiles: int  # grid axis 0: T // block_q + S (tiles without queries exit at once)
    partition_size: int  # keys per split-KV partition; 0 = no split
    num_partitions: int  # grid axis 2: cdiv(keys one tile can see, partition_size)
    num_warps: int = 4
    num_stages: int | None = None  # None: Triton's default for the device


def _check_window(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    check(
        sliding_window is None or sliding_window >= 1,
        f"sliding_window must be None or >= 1, got {sliding_window}",
    )
    check(
        logits_soft_cap is None or logits_soft_cap > 0,
        f"logits_soft_cap must be None or > 0, got {logits_soft_cap}",
    )


def _kv_span(max_seq_len: int, max_query_len: int, block_q: int, sliding_window: int | None) -> int:
    """Most keys one query tile can see: the whole context, or with a window W the window of
    its first query plus its other queries (see paged_attention_kernel's doc)."""
    if sliding_window is None:
        return max_seq_len
    return min(max_seq_len, sliding_window + min(max_query_len, block_q) - 1)


def plan_paged_attention(
    device: torch.device,
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_query_len: int,
    max_seq_len: int,
    *,
    partition_size: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> AttentionPlan:
    """Tile sizes and the split-KV decision for a batch of T tokens from S sequences.

    partition_size: KV partition length in tokens for split-KV (flash-decoding); None picks
    automatically (splits when the batch is too small to fill the GPU), 0 never splits.
    tile_n: keys per inner-loop step (power of two >= 16); None picks by head_dim.
    num_warps / num_stages: Triton launch options (for tuning). num_warps None: 2 for tiles
    of 16 rows (decode batches; 4 warps idle there) over a pool that is not int8, else 4.
    kv_dtype: the pool's dtype (None: the query's).
    sliding_window: the layer's window (None = none). A windowed tile walks at most
    W + block_q - 1 keys, which is what split-KV partitions; a plan made without a window also
    serves windowed layers (with partitions to spare), not the other way round."""
    _check_window(sliding_window, None)
    check(
        num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
        f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}",
    )
    group_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)
    # Rows per program: up to 64 (token, head) pairs, at least 16 (tl.dot's minimum).
    block_q = max(1, min(triton.next_power_of_2(max(max_query_len, 1)), 64 // group_pad))
    block_m = max(16, block_q * group_pad)
    block_q = block_m // group_pad
    if tile_n is None:
        tile_n = 64 if triton.next_power_of_2(head_dim) <= 64 else 32
    check(
        tile_n >= 16 and tile_n & (tile_n - 1) == 0,
        f"tile_n must be a power of two >= 16, got {tile_n}",
    )
    num_tiles = num_tokens // block_q + num_seqs
    busy_tiles = num_seqs if max_query_len <= block_q else num_tiles
    kv_span = _kv_span(max_seq_len, max_query_len, block_q, sliding_window)
    if partition_size is None:
        partition_size = _auto_partition_size(device, busy_tiles * num_kv_heads, kv_span, tile_n)
    check(partition_size >= 0, f"partition_size must be >= 0, got {partition_size}")
    num_partitions = triton.cdiv(kv_span, partition_size) if partition_size > 0 else 1
    if num_warps is None:
        # H200, SmolLM2 shapes, replayed from a CUDA graph: 2 warps read the KV 0-16 points of
        # the copy bandwidth faster than 4 at every decode shape measured (docs/benchmarks/gpu.md).
        # Larger tiles and int8 pools (the dequantizing loads) keep 4: 2 warps spill there.
        num_warps = 2 if block_m == 16 and kv_dtype != torch.int8 else 4
    return AttentionPlan(
        group_pad,
        block_q,
        block_m,
        tile_n,
        num_tiles,
        partition_size,
        num_partitions,
        num_warps,
        num_stages,
    )


def _check_plan(
    plan: AttentionPlan,
    num_tokens: int,
    num_seqs: int,
    queries_per_kv: int,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None,
) -> None:
    kv_span = _kv_span(max_seq_len, max_query_len, plan.block_q, sliding_window)
    check(
        plan.group_pad >= queries_per_kv
        and plan.block_m == plan.block_q * plan.group_pad
        and plan.num_tiles == num_tokens // plan.block_q + num_seqs
        and plan.partition_size * plan.num_partitions >= (kv_span if plan.partition_size else 0),
        f"{plan} was not made for this batch (T={num_tokens}, S={num_seqs}, "
        f"max_seq_len={max_seq_len}, sliding_window={sliding_window}); use plan_paged_attention",
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    *,
    plan: AttentionPlan | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Triton paged attention (module doc has the contract).

    max_query_len / max_seq_len: host-side maxima of the batch; pass them (the model runner
    knows them) — when None they are read from the device, which synchronises.
    plan: from `plan_paged_attention` for this batch (once per step, shared by all layers), or
    None to plan here with the defaults. A plan made for another sliding_window may not have
    enough split-KV partitions for this one (rejected).
    """
    _check_args(query, kv_cache, layer, block_tables, query_start_loc, seq_lens)
    _check_window(sliding_window, logits_soft_cap)
    num_tokens, num_q_heads, head_dim = query.shape
    _, num_kv_heads, _, _, block_size, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    check(
        max_seq_len <= block_tables.shape[1] * block_size,
        f"max_seq_len {max_seq_len} exceeds block table capacity "
        f"{block_tables.shape[1]} blocks x {block_size}",
    )
    if plan is None:
        plan = plan_paged_attention(
            query.device,
            num_tokens,
            num_seqs,
            num_q_heads,
            num_kv_heads,
            head_dim,
            max_query_len,
            max_seq_len,
            sliding_window=sliding_window,
            kv_dtype=kv_cache.dtype,
        )
    _check_plan(
        plan,
        num_tokens,
        num_seqs,
        num_q_heads // num_kv_heads,
        max_query_len,
        max_seq_len,
        sliding_window,
    )
    partition_size, num_partitions = plan.partition_size, plan.num_partitions
    if partition_size > 0:
        part_max = torch.empty(
            (num_tokens, num_q_heads, num_partitions), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(
            (num_tokens, num_q_heads, num_partitions, head_dim),
            dtype=torch.float32,
            device=query.device,
        )
    else:
        part_max = part_sum = part_acc = out  # unused by the kernel

    paged_attention_kernel[(plan.num_tiles, num_kv_heads, num_partitions)](
        out,
        part_acc,
        part_max,
        part_sum,
        query,
        kernel_view(kv_cache),
        block_tables,
        query_start_loc,
        seq_lens,
        scale * LOG2E,
        (logits_soft_cap or 1.0) * LOG2E,
        sliding_window or 0,
        num_seqs,
        num_q_heads,
        num_partitions,
        partition_size,
        layer * kv_cache.stride(2),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(3),
        kv_cache.stride(4),
        kv_cache.stride(1),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        QUERIES_PER_KV=num_q_heads // num_kv_heads,
        GROUP_PAD=plan.group_pad,
        BLOCK_M=plan.block_m,
        BLOCK_Q=plan.block_q,
        TILE_N=plan.tile_n,
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        SPLIT_KV=partition_size > 0,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST_DOT=query.dtype == torch.bfloat16 and _INTERPRETED,
        KV_FORMAT=format_code(kv_cache),
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=logits_soft_cap is not None,
        num_warps=plan.num_warps,
        **({} if plan.num_stages is None else {"num_stages": plan.num_stages}),
    )
    if partition_size > 0:
        merge_partitions(out, part_acc, part_max, part_sum)
    return out


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Plain-torch paged attention, one sequence at a time, fp32 math over the dequantized pool
    (`dequantize_kv_reference`; same contract: with a window it reads only the blocks from the
    one holding the sequence's first visible key).
    max_query_len / max_seq_len are accepted for interface parity and ignored."""
    _check_args(query, kv_cache, layer, block_tables, query_start_loc, seq_lens)
    _check_window(sliding_window, logits_soft_cap)
    num_tokens, num_q_heads, head_dim = query.shape
    _, num_kv_heads, _, _, block_size, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    check(
        starts[0] == 0 and starts[-1] == num_tokens,
        f"query_start_loc must run from 0 to T={num_tokens}, got {starts}",
    )
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    for s, seq_len in enumerate(lens):
        q = query[starts[s] : starts[s + 1]].float()
        q_len = q.shape[0]
        check(0 <= q_len <= seq_len, f"sequence {s}: q_len {q_len} > seq_len {seq_len}")
        if q_len == 0:
            continue
        first = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)
        first_block = first // block_size  # keys from first_block * block_size on
        blocks = block_tables[s, first_block : triton.cdiv(seq_len, block_size)].long()
        num_keys = seq_len - first_block * block_size
        # [blocks, H, B, D] -> [blocks * B, H, D]
        k = kv_cache[blocks, :, layer, 0].transpose(1, 2).flatten(0, 1)[:num_keys]
        v = kv_cache[blocks, :, layer, 1].transpose(1, 2).flatten(0, 1)[:num_keys]
        k, v = dequantize_kv_reference(k), dequantize_kv_reference(v)
        k = k.repeat_interleave(group, dim=1)  # [num_keys, num_q_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[None, :, None]
        k_pos = torch.arange(first_block * block_size, seq_len, device=query.device)[None, None, :]
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        out[starts[s] : starts[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(
            query.dtype
        )
    return out
