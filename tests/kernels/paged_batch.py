"""Builders for paged-attention test batches: one logical batch (queries + every sequence's
keys/values) that can be laid out in pools of different block sizes, with shuffled (non-
contiguous) block ids, prefix blocks shared between sequences and a NaN-filled pool so that
reading any slot that was never written poisons the result."""

from dataclasses import dataclass

import torch

from kernels import store_kv_reference


@dataclass(frozen=True)
class SeqSpec:
    seq_len: int  # context length including this step's queries
    q_len: int  # queries this step (the last q_len positions)
    share_from: int | None = None  # index of an earlier sequence whose prefix blocks we reuse
    shared_tokens: int = 0  # how many leading positions are shared (multiple of every block size)


# A prefill/decode mix: prefill from scratch, decodes crossing / ending on block boundaries,
# a chunked prefill on top of cached context, a sequence with no query this step, and two
# sequences that reuse the first sequence's first 32 positions (prefix-cache hits).
MIXED = (
    SeqSpec(45, 45),
    SeqSpec(70, 1, share_from=0, shared_tokens=32),
    SeqSpec(64, 1),
    SeqSpec(53, 12, share_from=0, shared_tokens=32),
    SeqSpec(33, 1),
    SeqSpec(20, 0),
    SeqSpec(17, 17),
)


@dataclass
class LogicalBatch:
    specs: tuple[SeqSpec, ...]
    query: torch.Tensor  # [T, num_q_heads, head_dim]
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]

    @property
    def query_start_loc(self) -> torch.Tensor:
        q_lens = torch.tensor([0] + [s.q_len for s in self.specs])
        return q_lens.cumsum(0).to(torch.int32).to(self.query.device)

    @property
    def seq_lens(self) -> torch.Tensor:
        return torch.tensor(
            [s.seq_len for s in self.specs], dtype=torch.int32, device=self.query.device
        )

    @property
    def max_query_len(self) -> int:
        return max(s.q_len for s in self.specs)

    @property
    def max_seq_len(self) -> int:
        return max(s.seq_len for s in self.specs)


@dataclass
class PagedBatch:
    logical: LogicalBatch
    kv_cache: torch.Tensor
    layer: int
    block_tables: torch.Tensor

    def args(self) -> tuple:
        lb = self.logical
        return (
            lb.query,
            self.kv_cache,
            self.layer,
            self.block_tables,
            lb.query_start_loc,
            lb.seq_lens,
        )


def make_logical(
    specs,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
) -> LogicalBatch:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    keys, values = [], []
    for spec in specs:
        k, v = (
            rand(spec.seq_len, num_kv_heads, head_dim),
            rand(spec.seq_len, num_kv_heads, head_dim),
        )
        if spec.share_from is not None:
            k[: spec.shared_tokens] = keys[spec.share_from][: spec.shared_tokens]
            v[: spec.shared_tokens] = values[spec.share_from][: spec.shared_tokens]
        keys.append(k)
        values.append(v)
    query = rand(sum(s.q_len for s in specs), num_q_heads, head_dim)
    return LogicalBatch(tuple(specs), query, keys, values)


def poison_value(kv_dtype: torch.dtype):
    """What fills a pool slot so that reading it gives NaN (int8: -1 bytes make a NaN scale)."""
    return -1 if kv_dtype == torch.int8 else float("nan")


def lay_out(
    logical: LogicalBatch,
    block_size: int,
    *,
    num_layers: int = 2,
    layer: int = 1,
    spare_blocks: int = 3,
    unused_entry: int = -1,
    seed: int = 1,
    kv_dtype: torch.dtype | None = None,
    poison: bool = True,
) -> PagedBatch:
    """Place the logical batch in a fresh NaN-filled pool with shuffled block ids. kv_dtype: the
    pool's dtype (default the query's; fp8 / int8 make a quantized pool, int8 with head_dim + 4
    bytes per row, filled with -1 bytes so that an unwritten scale reads as NaN). poison=False
    fills the pool with zeros instead, for readers that load (and mask) the unwritten tail of a
    sequence's last block, as the torch backend's batched paths do."""
    specs = logical.specs
    _, num_kv_heads, head_dim = logical.keys[0].shape
    blocks_per_seq = [-(-s.seq_len // block_size) for s in specs]
    shared_blocks = [s.shared_tokens // block_size for s in specs]
    for s, n in zip(specs, shared_blocks):
        assert n * block_size == s.shared_tokens, "shared prefix must be whole blocks"
    num_blocks = sum(blocks_per_seq) - sum(shared_blocks) + spare_blocks
    device = logical.query.device
    kv_dtype = kv_dtype or logical.query.dtype
    d_stored = head_dim + 4 if kv_dtype == torch.int8 else head_dim
    kv_cache = torch.full(
        (num_blocks, num_kv_heads, num_layers, 2, block_size, d_stored),
        poison_value(kv_dtype) if poison else 0,
        dtype=kv_dtype,
        device=device,
    )
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.full((len(specs), max(blocks_per_seq) + 2), unused_entry, dtype=torch.int32)
    slots, keys, values = [], [], []
    for i, spec in enumerate(specs):
        n_shared = shared_blocks[i]
        if n_shared:
            tables[i, :n_shared] = tables[spec.share_from, :n_shared]
        for j in range(n_shared, blocks_per_seq[i]):
            tables[i, j] = free.pop()
        positions = torch.arange(spec.shared_tokens, spec.seq_len)
        slots.append(
            tables[i, positions // block_size].long() * block_size + positions % block_size
        )
        keys.append(logical.keys[i][spec.shared_tokens :])
        values.append(logical.values[i][spec.shared_tokens :])
    store_kv_reference(
        torch.cat(keys), torch.cat(values), kv_cache, layer, torch.cat(slots).to(device)
    )
    return PagedBatch(logical, kv_cache, layer, tables.to(device))


def dense_causal_attention(
    logical: LogicalBatch,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Independent oracle: each sequence's contiguous K/V through torch SDPA with an explicit
    causal mask for its last q_len positions; with a window the mask also hides keys j with
    p - j >= sliding_window; with a soft-cap, explicit fp32 scores c * tanh(s / c) instead."""
    out = torch.empty_like(logical.query, dtype=torch.float32)
    num_q_heads = logical.query.shape[1]
    start = 0
    for spec, k, v in zip(logical.specs, logical.keys, logical.values):
        if spec.q_len == 0:
            continue
        group = num_q_heads // k.shape[1]
        q = logical.query[start : start + spec.q_len].float().transpose(0, 1)  # [H, q, D]
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(spec.seq_len - spec.q_len, spec.seq_len, device=q.device)
        k_pos = torch.arange(spec.seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos[:, None]
        if sliding_window is not None:
            mask &= q_pos[:, None] - k_pos < sliding_window
        if logits_soft_cap is None:
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale
            )
        else:
            scores = logits_soft_cap * torch.tanh(q @ k.transpose(1, 2) * scale / logits_soft_cap)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        out[start : start + spec.q_len] = o.transpose(0, 1)
        start += spec.q_len
    return out
