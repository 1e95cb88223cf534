"""Attention in plain torch (CPU reference path; also runs on CUDA).

The pool ([N, H, L, 2, B, D], engine/kv/kv_pool.py) is addressed as pages:
`kv_cache.view(-1, block_size, D)` where page `((block * H + head) * L + layer) * 2 + kv` is one
kv head's rows of one layer's K (kv=0) or V (kv=1) of one block. `index_select`/`index_copy_`
on that view are much cheaper than advanced indexing into the 6-D pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kv.kv_format import dequantize, quantize


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """One-byte pools (fp8, int8) as uint8: CPU index ops lack fp8 kernels."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _pages(kv_cache: torch.Tensor) -> torch.Tensor:
    return kv_cache.view(-1, *kv_cache.shape[4:])  # [N * H * L * 2, B, D]


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    metadata: AttentionMetadata | None = None,
) -> None:
    """Writes key/value [T, Hkv, D] at `slot_mapping` (-1 = skip) of `layer`. With
    `metadata` (whose slot_mapping this is), the rows and the skip filter are worked out once
    per step and cached on it (every layer of a step stores at the same slots)."""
    num_heads, num_layers, block_size = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[4]
    plan = metadata.store_plan if metadata is not None else None
    if plan is None or plan[0] != kv_cache.shape[1:5]:
        valid = slot_mapping >= 0
        keep = None if bool(valid.all()) else valid.nonzero().squeeze(1)
        slots = slot_mapping if keep is None else slot_mapping[keep]
        # Row of (token, head)'s layer-0 K in the row view:
        # (((block * H + head) * L + 0) * 2 + 0) * B + offset, [T, H] flattened.
        heads = torch.arange(num_heads, device=slots.device)
        page = (slots // block_size)[:, None] * num_heads + heads[None, :]
        base = (page * num_layers * 2 * block_size + (slots % block_size)[:, None]).flatten()
        plan = (kv_cache.shape[1:5], base, keep)
        if metadata is not None:
            metadata.store_plan = plan
    _, base, keep = plan
    if keep is not None:
        key, value = key[keep], value[keep]
    rows = kv_cache.view(-1, kv_cache.shape[-1])  # one row per (page, offset)
    k_rows = base + layer * 2 * block_size
    # Byte views: index_copy_ has no fp8 kernel on CPU (and bytes are what moves anyway).
    raw = _bytes(rows)
    k = quantize(key, kv_cache.dtype).reshape(-1, kv_cache.shape[-1])
    v = quantize(value, kv_cache.dtype).reshape(-1, kv_cache.shape[-1])
    raw.index_copy_(0, k_rows, _bytes(k))
    raw.index_copy_(0, k_rows + block_size, _bytes(v))


def gather_kv(
    kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks in `block_tables` ([..., nb]) as [..., H, nb * B, D] each (heads
    first, as SDPA takes them), in `like`'s dtype and head size (dequantized when the pool is
    fp8 / int8, engine/kv/kv_format.py)."""
    num_heads, num_layers = kv_cache.shape[1], kv_cache.shape[2]
    pages = _bytes(_pages(kv_cache))
    heads = torch.arange(num_heads, device=block_tables.device)
    # [..., H, nb]: page of (block, head)'s layer K.
    pages_of = block_tables.long().unsqueeze(-2) * num_heads + heads[:, None]
    k_pages = (pages_of * num_layers + layer) * 2
    shape = (*block_tables.shape[:-1], num_heads, -1, pages.shape[-1])
    k = pages.index_select(0, k_pages.flatten()).view(shape).view(kv_cache.dtype)
    v = pages.index_select(0, (k_pages + 1).flatten()).view(shape).view(kv_cache.dtype)
    if kv_cache.dtype != like.dtype:
        head_dim = like.shape[-1]
        k, v = dequantize(k, head_dim, like.dtype), dequantize(v, head_dim, like.dtype)
    return k, v


def _attend(q, k, v, mask, scale, soft_cap: float | None, causal: bool = False) -> torch.Tensor:
    """Attention of q [..., R, D] over k/v [..., L, D] (same leading dims) under the boolean
    mask (broadcastable to [..., R, L]; True = visible). SDPA, or with soft-capping the same in
    explicit fp32 math (SDPA has no soft-cap)."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale
        )
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def _first_key(seq_len: int, q_len: int, window: int | None) -> int:
    """The first key any of the sequence's queries sees (AttentionBackend's window contract)."""
    return 0 if window is None else max(0, seq_len - q_len - window + 1)


def _window_tables(block_tables, first_key, seq_lens, num_blocks: int, block_size: int):
    """Per sequence, the num_blocks table entries from the block holding first_key [S] on, and
    the position of each one's first key [S]. Entries past a sequence's last block repeat that
    block (masked out by position): no entry before the window or past the end is read."""
    first_block = first_key // block_size
    last_block = (seq_lens - 1) // block_size
    idx = first_block[:, None] + torch.arange(num_blocks, device=block_tables.device)
    idx = torch.minimum(idx, last_block[:, None])
    return block_tables.gather(1, idx.to(torch.int64)), first_block * block_size


SHORT_QUERY = 16
"""Sequences with at most this many query rows after a cached context (verify rows of
speculating sequences) are batched in one padded call, like decodes."""


def _leading_short(metadata: AttentionMetadata, first: int) -> int:
    """End of the run of short-query sequences starting at `first` that attend to a cached
    context (not whole-prompt prefills)."""
    s = first
    while (
        s < metadata.num_seqs
        and metadata.query_lens_cpu[s] <= SHORT_QUERY
        and metadata.seq_lens_cpu[s] > metadata.query_lens_cpu[s]
    ):
        s += 1
    return s


class TorchAttentionBackend(AttentionBackend):
    """Decodes batched in one padded SDPA call; prefill chunks one SDPA call per sequence.
    With a sliding window each sequence gathers only the blocks from its window's first one.

    On the CPU, decode rows over a pool in the model's dtype go to the C++ kernel that reads
    K/V in place (engine/cpu_kernels) when it builds, prefill chunks of a bf16 model without a
    window or soft cap to its bf16 kernel (`paged_prefill`: AMX tiles, or AVX512-BF16 where
    there is no AMX), and a step's K/V rows are stored by its `store_kv_` (one call per
    layer) into such a pool; `cpu_kernels=False` keeps the gather + SDPA path and
    `store_kv_torch` everywhere (the references the kernels are tested against)."""

    name = "torch"

    def __init__(self, cpu_kernels: bool = True) -> None:
        self.cpu_kernels = cpu_kernels

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
        if self.cpu_kernels and cpu_kernels.stores_in_place(key, value, kv_cache):
            cpu_kernels.store_kv_(key, value, kv_cache, layer, metadata.slot_mapping)
        else:
            store_kv_torch(key, value, kv_cache, layer, metadata.slot_mapping, metadata)
        win, cap = sliding_window, logits_soft_cap
        nd = metadata.num_decodes
        in_place = (
            nd and self.cpu_kernels and cpu_kernels.fits(query, kv_cache) and cpu_kernels.load()
        )
        if in_place and nd == query.shape[0]:  # decodes only: the kernel's output is the result
            return cpu_kernels.paged_decode(
                query,
                kv_cache,
                layer,
                metadata.block_tables[:nd],
                metadata.seq_lens[:nd],
                scale,
                win,
                cap,
            )
        out = torch.empty_like(query)
        if in_place:
            out[:nd] = cpu_kernels.paged_decode(
                query[:nd],
                kv_cache,
                layer,
                metadata.block_tables[:nd],
                metadata.seq_lens[:nd],
                scale,
                win,
                cap,
            )
        elif nd:
            out[:nd] = self._decode(query[:nd], kv_cache, layer, metadata, scale, win, cap)
        start = nd  # decode rows are one token each
        short = _leading_short(metadata, nd)
        if short > nd:  # verify rows of speculating sequences: one padded call
            rows = sum(metadata.query_lens_cpu[nd:short])
            out[start : start + rows] = self._short(
                query[start : start + rows], kv_cache, layer, metadata, nd, short, scale, win, cap
            )
            start += rows
        if (
            short < metadata.num_seqs
            and win is None
            and cap is None
            and self.cpu_kernels
            and cpu_kernels.prefills_in_place(query, kv_cache)
        ):
            # Every remaining sequence in one call, K/V read from the pool.
            out[start:] = cpu_kernels.paged_prefill(
                query[start:],
                kv_cache,
                layer,
                metadata.block_tables[short:],
                metadata.seq_lens[short:],
                metadata.query_start_loc[short:].diff(),
                scale,
            )
            return out
        for s in range(short, metadata.num_seqs):
            q_len = metadata.query_lens_cpu[s]
            out[start : start + q_len] = self._prefill(
                query[start : start + q_len], kv_cache, layer, metadata, s, scale, win, cap
            )
            start += q_len
        return out

    @staticmethod
    def _prefill(query, kv_cache, layer, metadata: AttentionMetadata, s: int, scale, win, cap):
        """Sequence s's q_len queries (a whole prompt or a chunk after a cached context)."""
        block_size = kv_cache.shape[4]
        q_len, seq_len = metadata.query_lens_cpu[s], metadata.seq_lens_cpu[s]
        first = _first_key(seq_len, q_len, win)
        first_block, num_blocks = first // block_size, -(-seq_len // block_size)
        k, v = gather_kv(kv_cache, layer, metadata.block_tables[s, first_block:num_blocks], query)
        lo, hi = first - first_block * block_size, seq_len - first_block * block_size
        k, v = k[:, lo:hi], v[:, lo:hi]  # [Hkv, L, D], keys first..
        q = query.transpose(0, 1)  # [Hq, q_len, D]
        if q_len == seq_len and win is None and cap is None:
            mask, causal = None, True
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(first, seq_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if win is not None:
                mask &= k_pos > q_pos - win
            causal = False
        if cap is None:
            o = F.scaled_dot_product_attention(
                q.unsqueeze(0),
                k.unsqueeze(0),
                v.unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=True,
            )[0]
        else:  # query heads of one kv head stacked as rows: [Hkv, group * q_len, D]
            assert mask is not None  # built above whenever there is a cap
            num_kv_heads, head_dim = k.shape[0], k.shape[-1]
            group = q.shape[0] // num_kv_heads
            o = _attend(
                q.reshape(num_kv_heads, group * q_len, head_dim),
                k,
                v,
                mask.repeat(group, 1),
                scale,
                cap,
            )
            o = o.view(q.shape)
        return o.transpose(0, 1)

    @staticmethod
    def _short(
        query,
        kv_cache,
        layer,
        metadata: AttentionMetadata,
        first: int,
        end: int,
        scale,
        win=None,
        cap=None,
    ):
        """Sequences first..end-1, each a few query rows after a cached context (a
        speculating sequence's last token and drafts): padded to the longest, one SDPA
        call, query heads grouped per kv head as in `_decode`."""
        q_lens = metadata.query_lens_cpu[first:end]
        ns, q_max = end - first, max(q_lens)
        block_size = kv_cache.shape[4]
        seq_lens = metadata.seq_lens[first:end]
        q_len_t = torch.tensor(q_lens, device=query.device)
        if win is None:
            num_blocks = -(-max(metadata.seq_lens_cpu[first:end]) // block_size)
            tables, key0 = metadata.block_tables[first:end, :num_blocks], None
        else:
            firsts = [
                _first_key(n, q, win) for n, q in zip(metadata.seq_lens_cpu[first:end], q_lens)
            ]
            num_blocks = max(
                (n - 1) // block_size - f // block_size + 1
                for n, f in zip(metadata.seq_lens_cpu[first:end], firsts)
            )
            first_key = (seq_lens - q_len_t - win + 1).clamp(min=0)
            tables, key0 = _window_tables(
                metadata.block_tables[first:end], first_key, seq_lens, num_blocks, block_size
            )
            key0 = key0[:, None, None]
        k, v = gather_kv(kv_cache, layer, tables, query)  # [ns, Hkv, L, D]
        num_kv_heads, head_dim = k.shape[-3], k.shape[-1]
        group = query.shape[1] // num_kv_heads
        padded = query.new_zeros(ns, q_max, *query.shape[1:])
        row_of = torch.tensor(
            [i * q_max + t for i, n in enumerate(q_lens) for t in range(n)], device=query.device
        )
        padded.view(ns * q_max, *query.shape[1:])[row_of] = query
        # [ns, Hkv, q_max * group, D]: row t * group + g is query token t, head g of the group.
        grouped = padded.view(ns, q_max, num_kv_heads, group, head_dim).transpose(1, 2)
        grouped = grouped.reshape(ns, num_kv_heads, q_max * group, head_dim)
        # Token t of sequence i sits at position seq_len - q_len + t; padding rows see what
        # the last real row sees (their output is dropped).
        t = torch.arange(q_max, device=query.device)
        q_pos = (seq_lens - q_len_t)[:, None] + torch.minimum(t[None, :], q_len_t[:, None] - 1)
        keys = torch.arange(num_blocks * block_size, device=query.device)[None, None, :]
        if key0 is not None:
            keys = keys + key0
        mask = keys <= q_pos[:, :, None]  # [ns, q_max, L]
        if win is not None:
            mask &= keys > q_pos[:, :, None] - win
        mask = mask.repeat_interleave(group, dim=1)[:, None]  # [ns, 1, q_max * group, L]
        o = _attend(grouped, k, v, mask, scale, cap)
        o = o.view(ns, num_kv_heads, q_max, group, head_dim).transpose(1, 2)
        return o.reshape(ns * q_max, *query.shape[1:])[row_of]

    @staticmethod
    def _decode(query, kv_cache, layer, metadata: AttentionMetadata, scale, win=None, cap=None):
        nd = query.shape[0]
        block_size = kv_cache.shape[4]
        seq_lens = metadata.seq_lens[:nd]
        if win is None:
            num_blocks = -(-max(metadata.seq_lens_cpu[:nd]) // block_size)
            k, v = gather_kv(kv_cache, layer, metadata.block_tables[:nd, :num_blocks], query)
            positions = torch.arange(num_blocks * block_size, device=query.device)
            mask = (positions[None, :] < seq_lens[:, None]).view(nd, 1, 1, -1)
        else:  # keys seq_len - win .. seq_len - 1, from the block holding the first one
            num_blocks = max(
                (n - 1) // block_size - max(0, n - win) // block_size + 1
                for n in metadata.seq_lens_cpu[:nd]
            )
            tables, key0 = _window_tables(
                metadata.block_tables[:nd],
                (seq_lens - win).clamp(min=0),
                seq_lens,
                num_blocks,
                block_size,
            )
            k, v = gather_kv(kv_cache, layer, tables, query)
            positions = torch.arange(num_blocks * block_size, device=query.device) + key0[:, None]
            mask = (positions < seq_lens[:, None]) & (positions >= seq_lens[:, None] - win)
            mask = mask.view(nd, 1, 1, -1)
        # The query heads sharing a kv head ride in SDPA's query-length dimension: no GQA
        # expansion of K/V (measured 8x faster in bf16 on CPU than enable_gqa).
        num_kv_heads, head_dim = k.shape[-3], k.shape[-1]  # k, v: [nd, Hkv, L, D]
        grouped = query.view(nd, num_kv_heads, -1, head_dim)  # [nd, Hkv, Hq/Hkv, D]
        o = _attend(grouped, k, v, mask, scale, cap)
        return o.reshape(query.shape)
