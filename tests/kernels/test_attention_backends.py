"""Both attention backends (torch; Triton, interpreted on CPU) against the dense oracle over a
batch laid out as the model runner does (decodes first, then verify rows, a whole prompt and a
chunked prefill on a cached context), with and without sliding window and logit soft-capping;
and neither reads a block wholly before a sequence's window."""

import functools
import math

import pytest
import torch
from paged_batch import SeqSpec, dense_causal_attention, lay_out, make_logical, poison_value

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from kernels import dequantize_kv_reference

HEAD_DIM = 32
SCALE = 1 / math.sqrt(HEAD_DIM)
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.5e-2, rtol=1.5e-2)}
SPECS = (
    SeqSpec(70, 1),
    SeqSpec(33, 1),
    SeqSpec(5, 1),
    SeqSpec(64, 1),  # decodes (batched)
    SeqSpec(53, 4, share_from=0, shared_tokens=32),
    SeqSpec(40, 16),  # verify rows (_short)
    SeqSpec(45, 45),  # a whole prompt
    SeqSpec(90, 30, share_from=0, shared_tokens=32),  # a prefill chunk after a cached context
)
# "torch": decodes through the C++ kernel where it builds (engine/cpu_kernels);
# "torch_gather": the gather + SDPA path everywhere.
BACKENDS = {
    "torch": TorchAttentionBackend,
    "triton": TritonAttentionBackend,
    "torch_gather": functools.partial(TorchAttentionBackend, cpu_kernels=False),
}


def _batch(dtype=torch.float32, kv_dtype=None, block_size=16, device="cpu"):
    logical = make_logical(
        SPECS, num_q_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, dtype=dtype, device=device
    )
    # Zero-filled pool: the torch backend's batched paths load (and mask) the unwritten tail
    # of a sequence's last block. Table padding is 0, as the model runner pads.
    return lay_out(logical, block_size, unused_entry=0, kv_dtype=kv_dtype, poison=False)


def _metadata(batch) -> AttentionMetadata:
    lb, block_size = batch.logical, batch.kv_cache.shape[4]
    table = batch.block_tables
    slots = [
        table[s, p // block_size].long() * block_size + p % block_size
        for s, spec in enumerate(lb.specs)
        for p in range(spec.seq_len - spec.q_len, spec.seq_len)
    ]
    q_lens = [s.q_len for s in lb.specs]
    return AttentionMetadata(
        slot_mapping=torch.stack(slots),
        query_start_loc=lb.query_start_loc,
        seq_lens=lb.seq_lens,
        block_tables=table,
        query_lens_cpu=q_lens,
        seq_lens_cpu=[s.seq_len for s in lb.specs],
        num_decodes=next(i for i, n in enumerate(q_lens) if n != 1),
        max_query_len=lb.max_query_len,
        max_seq_len=lb.max_seq_len,
    )


def _forward(name, batch, **options):
    """One layer's forward: stores this step's K/V (already in the pool: same bytes) and attends."""
    lb = batch.logical
    new_k = torch.cat([k[s.seq_len - s.q_len :] for s, k in zip(lb.specs, lb.keys)])
    new_v = torch.cat([v[s.seq_len - s.q_len :] for s, v in zip(lb.specs, lb.values)])
    return BACKENDS[name]().forward(
        lb.query, new_k, new_v, batch.kv_cache, batch.layer, _metadata(batch), SCALE, **options
    )


def _dense(logical, window=None, cap=None):
    return dense_causal_attention(logical, SCALE, sliding_window=window, logits_soft_cap=cap)


def test_metadata_is_laid_out_as_the_runner_does():
    md = _metadata(_batch())
    assert md.num_decodes == 4 and md.max_query_len == 45


@pytest.mark.parametrize("name", BACKENDS)
def test_default_is_plain_causal_attention(name, device):
    batch = _batch(device=device)
    torch.testing.assert_close(_forward(name, batch), _dense(batch.logical), **TOL[torch.float32])


# Windows: one key; not a multiple of the block size; one block; the prompt's whole length;
# longer than every context.
@pytest.mark.parametrize(
    "window,cap", [(1, None), (7, 1.5), (16, None), (45, 1.5), (500, None), (None, 1.5)]
)
@pytest.mark.parametrize("name", BACKENDS)
def test_window_and_soft_cap(name, window, cap, device):
    batch = _batch(device=device)
    out = _forward(name, batch, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(out, _dense(batch.logical, window, cap), **TOL[torch.float32])


@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("name", BACKENDS)
def test_window_bf16(name, cap, device):
    batch = _batch(torch.bfloat16, block_size=32, device=device)
    out = _forward(name, batch, sliding_window=24, logits_soft_cap=cap)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _dense(batch.logical, 24, cap), **TOL[torch.bfloat16])


@pytest.mark.parametrize("kv_dtype,cap", [(torch.int8, 2.0), (torch.float8_e4m3fn, None)])
@pytest.mark.parametrize("name", BACKENDS)
def test_window_quantized_pool(name, kv_dtype, cap, device):
    batch = _batch(kv_dtype=kv_dtype, device=device)
    out = _forward(name, batch, sliding_window=20, logits_soft_cap=cap)
    # Oracle: dense attention over what the pool gives back for each sequence's keys.
    pool, block_size = batch.kv_cache, batch.kv_cache.shape[4]
    keys, values = [], []
    for s, spec in enumerate(batch.logical.specs):
        blocks = batch.block_tables[s, : -(-spec.seq_len // block_size)].long()
        k, v = (pool[blocks, :, batch.layer, kv].transpose(1, 2).flatten(0, 1) for kv in (0, 1))
        keys.append(dequantize_kv_reference(k[: spec.seq_len]))
        values.append(dequantize_kv_reference(v[: spec.seq_len]))
    logical = type(batch.logical)(batch.logical.specs, batch.logical.query, keys, values)
    torch.testing.assert_close(out, _dense(logical, 20, cap), atol=1e-4, rtol=1e-4)


def _poison_stale_blocks(batch, window, stale_entry=None):
    """Point every table entry wholly before its sequence's window, and the padding, at a NaN
    block (or at stale_entry), and fill every block that no remaining entry names with NaN."""
    table, pool = batch.block_tables, batch.kv_cache
    block_size = pool.shape[4]
    keep = torch.zeros(table.shape, dtype=torch.bool, device=table.device)
    for s, spec in enumerate(batch.logical.specs):
        first = max(0, spec.seq_len - spec.q_len - window + 1)
        keep[s, first // block_size : -(-spec.seq_len // block_size)] = True
    live = set(table[keep].tolist())
    dead = [b for b in range(pool.shape[0]) if b not in live]
    table[~keep] = dead[0] if stale_entry is None else stale_entry
    pool[dead] = poison_value(pool.dtype)
    return sum(
        1
        for s in range(table.shape[0])
        for j in range(table.shape[1])
        if not keep[s, j] and j * block_size < batch.logical.specs[s].seq_len
    )


@pytest.mark.parametrize(
    "window,cap,kv_dtype", [(7, None, None), (20, 2.0, None), (20, None, torch.int8)]
)
@pytest.mark.parametrize("name", BACKENDS)
def test_blocks_before_the_window_are_never_read(name, window, cap, kv_dtype, device):
    batch = _batch(kv_dtype=kv_dtype, device=device)
    before = _forward(name, batch, sliding_window=window, logits_soft_cap=cap)
    # The torch backend's index ops raise on a block id past the pool (on CPU; CUDA would
    # assert): a gather of stale entries fails even where slicing would drop what it read.
    out_of_range = (
        batch.kv_cache.shape[0] + 5 if name.startswith("torch") and device == "cpu" else None
    )
    assert _poison_stale_blocks(batch, window, out_of_range) >= 8, (
        "too few stale blocks to test anything"
    )
    after = _forward(name, batch, sliding_window=window, logits_soft_cap=cap)
    assert after.isfinite().all()
    torch.testing.assert_close(after, before, atol=0, rtol=0)
