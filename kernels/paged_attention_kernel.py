"""The Triton kernel behind `kernels.paged_attention`: causal attention of a ragged batch of
queries over keys/values gathered from the paged pool through each sequence's block table.

Work decomposition (grid = (query tiles, kv heads, KV partitions)):
- A query tile is BLOCK_Q consecutive query tokens of ONE sequence times the GROUP_PAD query
  heads that share one kv head (GQA packing: each K/V tile is loaded once for the whole group).
  Row r of the tile is (token r // GROUP_PAD, head r % GROUP_PAD). Tiles are numbered without
  a host-side schedule: sequence s owns tiles [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1),
  an upper bound of what it needs; a program finds its sequence by binary search and exits if
  its tile has no queries. The grid is therefore T // BLOCK_Q + S tiles, known without a sync.
- Keys are visited in tiles of TILE_N positions, independent of the pool's block size: each key
  position looks up its own block id, so a tile may span several pool blocks.
- SPLIT_KV off: one program walks all keys the tile can see and writes the output.
  SPLIT_KV on (flash-decoding): program p only walks keys
  [p * partition_size, (p + 1) * partition_size) and writes its unnormalised partial output
  with its running max and sum; `merge_partitions_kernel` combines them. A long decode context
  is thus spread over many programs instead of one serial walk. partition_size is a runtime
  argument so that a size chosen per step does not trigger a recompilation.
- USE_WINDOW (sliding window W = `sliding_window`): a query at position p sees keys j with
  p - W < j <= p. The tile's KV walk starts at kv_first = max(0, p0 - W + 1), p0 the position of
  its first query: whole KV tiles (and pool blocks) before the window are never visited, their
  block-table entries never read; rows whose window starts later are masked within the walk.
  Partitions (SPLIT_KV) are counted from kv_first, so a windowed launch needs only
  cdiv(W + BLOCK_Q - 1, partition_size) of them.
- USE_SOFT_CAP: scores become c * tanh(scores / c) before the mask (Gemma 2). `soft_cap` is c in
  the base-2 units of the scores (c * log2(e)), which leaves the result unchanged.

KV_FORMAT (kernels/kv_quant.py): AUTO reads K/V in the query dtype. FP8_E4M3 / FP8_E5M2 read the
pool as bytes and decode them exactly to the query dtype (fp8 fits fp16/bf16 exactly; e4m3 by
bit arithmetic, as sm_80 has no e4m3 conversion). INT8 puts
the integers (exact in any float dtype) into the dots and applies the per-key scales outside
them: scores *= k_scale per key column, and P is multiplied by v_scale per key column before it
is rounded for the P @ V dot. Each scale is the float32 after its head's head_dim bytes.

UPCAST_DOT: the Triton interpreter (CPU, triton 3.7) computes tl.dot on bf16 operands wrongly;
there the operands are upcast to fp32 after the same bf16 rounding. Never set on GPU.

Softmax runs in base 2 (qk_scale already includes log2(e)); statistics are fp32.
"""

import triton
import triton.language as tl

from kernels.kv_quant import FP8_E4M3, FP8_E5M2, INT8, decode_e4m3

# Running max before any key was seen: finite, so that a row whose keys are all masked in this
# partition gives exp2(-inf - EMPTY_MAX) = 0 and never inf - inf = nan.
EMPTY_MAX = tl.constexpr(-1.0e30)


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest s with query_start_loc[s] // BLOCK_Q + s <= tile (that start is strictly
    increasing in s, and is 0 for s = 0)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    """tanh through exp2 (libdevice.tanh does not run under the interpreter); saturates
    cleanly to +-1 when exp2 overflows or underflows."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)


@triton.jit
def _kv_for_dot(x, dot_dtype: tl.constexpr, KV_FORMAT: tl.constexpr):
    """Loaded K/V as stored -> the dot operand dtype (exact: fp8 and int8 values fit)."""
    if KV_FORMAT == FP8_E4M3:
        x = decode_e4m3(x)
    elif KV_FORMAT == FP8_E5M2:
        x = x.to(tl.float8e5, bitcast=True)  # converted natively (all archs, and exact)
    return x.to(dot_dtype)


@triton.jit
def paged_attention_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_ptr,
    kv_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
    soft_cap,
    sliding_window,
    num_seqs,
    num_q_heads,
    num_partitions,
    partition_size,
    layer_offset,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # the sequence's first query sits at this position

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD
    in_group = rows % GROUP_PAD
    head = kv_head * QUERIES_PER_KV + in_group
    row_ok = (q_idx < q_len) & (in_group < QUERIES_PER_KV)
    token = (q_start + q_idx).to(tl.int64)
    q_pos = context_len + q_idx
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(
        query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # Keys this tile can see: kv_first .. position of its last query. With a window, kv_first
    # is where the first query's window starts; nothing before it is loaded (its blocks may be
    # released, their table entries stale).
    kv_stop = context_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    if USE_WINDOW:
        kv_first = tl.maximum(context_len + q_tile * BLOCK_Q - sliding_window + 1, 0)
    else:
        kv_first = 0
    if SPLIT_KV:
        kv_lo = kv_first + part * partition_size
        kv_hi = tl.minimum(kv_stop, kv_lo + partition_size)
    else:
        kv_lo = kv_first
        kv_hi = kv_stop

    m_i = tl.full([BLOCK_M], EMPTY_MAX, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    k_base = kv_ptr + layer_offset + kv_head * stride_ch
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, TILE_N):
        n = start + tl.arange(0, TILE_N)
        n_ok = n < kv_hi
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (n % BLOCK_SIZE) * stride_cs
        k = tl.load(
            k_base + kv_off[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0
        )
        k = _kv_for_dot(k, q.dtype, KV_FORMAT)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if KV_FORMAT == INT8:
            k_scale = tl.load(
                (k_base + kv_off + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=n_ok, other=0.0
            )
            s = s * k_scale[None, :]
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            k_base + stride_ckv + kv_off[:, None] + d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0,
        )
        v = _kv_for_dot(v, q.dtype, KV_FORMAT)
        if KV_FORMAT == INT8:
            v_scale = tl.load(
                (k_base + stride_ckv + kv_off + HEAD_DIM).to(tl.pointer_type(tl.float32)),
                mask=n_ok,
                other=0.0,
            )
            p = p * v_scale[None, :]
        # P is rounded to the query dtype (the KV dtype when unquantized) as on GPU, even when
        # UPCAST_DOT then computes the dot in fp32.
        p = p.to(query_ptr.dtype.element_ty).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    io_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT_KV:
        stat = (token * num_q_heads + head) * num_partitions + part
        tl.store(part_max_ptr + stat, m_i, mask=row_ok)
        tl.store(part_sum_ptr + stat, l_i, mask=row_ok)
        tl.store(part_acc_ptr + stat[:, None] * HEAD_DIM + d[None, :], acc, mask=io_mask)
    else:
        # Every real row saw its own key, so l_i > 0 there; padded rows are not stored.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )
