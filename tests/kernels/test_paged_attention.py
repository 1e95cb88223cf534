"""paged_attention (Triton) == paged_attention_reference (torch) == dense causal attention, also
over quantized pools (fp8 e4m3/e5m2, int8): there against dense attention over the dequantized
K/V."""

import dataclasses
import importlib
import math

import pytest
import torch
from paged_batch import MIXED, SeqSpec, dense_causal_attention, lay_out, make_logical, poison_value

from kernels import (
    dequantize_kv_reference,
    paged_attention,
    paged_attention_reference,
    plan_paged_attention,
    quantize_kv_reference,
)

# The package re-exports the function under the module's name; this is the module.
pa = importlib.import_module("kernels.paged_attention")

TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.5e-2, rtol=1.5e-2),
}
HEAD_DIM = 64
SCALE = 1 / math.sqrt(HEAD_DIM)


QUANTIZED = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


def _batch(
    specs=MIXED,
    *,
    gqa=3,
    num_kv_heads=3,
    dtype=torch.float32,
    block_size=16,
    head_dim=HEAD_DIM,
    device="cpu",
    seed=0,
    **layout,
):
    logical = make_logical(
        specs,
        num_q_heads=num_kv_heads * gqa,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        seed=seed,
    )
    return lay_out(logical, block_size, **layout)


def _dequantized(logical, kv_dtype):
    """The logical batch with its K/V replaced by what a kv_dtype pool gives back (fp32)."""

    def roundtrip(x):
        return dequantize_kv_reference(quantize_kv_reference(x, kv_dtype))

    return dataclasses.replace(
        logical,
        keys=[roundtrip(k) for k in logical.keys],
        values=[roundtrip(v) for v in logical.values],
    )


def _plan(batch, **plan_kw):
    lb, q = batch.logical, batch.logical.query
    return plan_paged_attention(
        q.device,
        q.shape[0],
        len(lb.specs),
        q.shape[1],
        batch.kv_cache.shape[1],
        q.shape[2],
        lb.max_query_len,
        lb.max_seq_len,
        **plan_kw,
    )


def _run(batch, fn=paged_attention, scale=SCALE, **plan_kw):
    """fn on the batch; plan_kw (partition_size=, tile_n=, ...) go to plan_paged_attention."""
    lb = batch.logical
    extra = {"plan": _plan(batch, **plan_kw)} if plan_kw else {}
    return fn(*batch.args(), scale, lb.max_query_len, lb.max_seq_len, **extra)


@pytest.mark.parametrize("gqa", [1, 3])
def test_reference_matches_dense_attention(gqa, device):
    batch = _batch(gqa=gqa, device=device)
    ref = _run(batch, paged_attention_reference)
    torch.testing.assert_close(
        ref, dense_causal_attention(batch.logical, SCALE), atol=1e-5, rtol=1e-5
    )


def test_reference_sees_wrong_block_table(device):
    # The dense oracle can tell a broken layout apart: swapping two blocks of one sequence.
    batch = _batch(device=device)
    batch.block_tables[0, [0, 1]] = batch.block_tables[0, [1, 0]]
    ref = _run(batch, paged_attention_reference)
    assert not torch.allclose(ref, dense_causal_attention(batch.logical, SCALE), atol=1e-3)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_reference_mixed_batch(dtype, gqa, block_size, device):
    batch = _batch(gqa=gqa, dtype=dtype, block_size=block_size, device=device)
    out = _run(batch)
    assert out.dtype == dtype and out.shape == batch.logical.query.shape
    torch.testing.assert_close(out, _run(batch, paged_attention_reference), **TOL[dtype])


def test_block_size_invariance(device):
    logical = make_logical(MIXED, num_q_heads=9, num_kv_heads=3, head_dim=HEAD_DIM, device=device)
    out16 = _run(lay_out(logical, 16, unused_entry=0))
    out32 = _run(lay_out(logical, 32, seed=7))
    torch.testing.assert_close(out16, out32, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out16, dense_causal_attention(logical, SCALE), **TOL[torch.float32])


@pytest.mark.parametrize("tile_n,block_size", [(16, 32), (32, 16), (64, 16)])
def test_key_tiles_independent_of_block_size(tile_n, block_size, device):
    batch = _batch(block_size=block_size, device=device)
    torch.testing.assert_close(
        _run(batch, tile_n=tile_n), _run(batch, paged_attention_reference), **TOL[torch.float32]
    )


def test_odd_head_dim_and_kv_heads(device):
    batch = _batch(gqa=2, num_kv_heads=2, head_dim=48, specs=MIXED[:3], device=device)
    torch.testing.assert_close(
        _run(batch, scale=0.3),
        _run(batch, paged_attention_reference, scale=0.3),
        **TOL[torch.float32],
    )


def _random_specs(num_seqs, max_len, seed):
    gen = torch.Generator().manual_seed(seed)

    def randint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    specs = []
    for i in range(num_seqs):
        seq_len = randint(1, max_len)
        q_len = 1 if randint(0, 1) else randint(1, seq_len)
        share_from, shared = None, 0
        if i and randint(0, 2) == 0:  # a prefix hit on an earlier sequence's whole 32-blocks
            share_from = randint(0, i - 1)
            shared = min(seq_len - q_len, specs[share_from].seq_len) // 32 * 32
        specs.append(SeqSpec(seq_len, q_len, share_from if shared else None, shared))
    return specs


@pytest.mark.parametrize("seed,partition_size", [(1, None), (2, 64), (3, 0)])
def test_random_batches(seed, partition_size, device):
    batch = _batch(
        _random_specs(8, 128, seed), block_size=32 if seed % 2 else 16, device=device, seed=seed
    )
    torch.testing.assert_close(
        _run(batch, partition_size=partition_size),
        dense_causal_attention(batch.logical, SCALE),
        **TOL[torch.float32],
    )


class _MergeSpy:
    def __init__(self, monkeypatch):
        self.calls = []
        real = pa.merge_partitions

        def spy(out, part_acc, part_max, part_sum):
            self.calls.append(part_max.shape[2])
            return real(out, part_acc, part_max, part_sum)

        monkeypatch.setattr(pa, "merge_partitions", spy)


DECODE = (
    SeqSpec(150, 1),
    SeqSpec(301, 1, share_from=0, shared_tokens=128),
    SeqSpec(77, 1),
    SeqSpec(1, 1),
)


@pytest.mark.parametrize(
    "dtype,partition_size", [(torch.float32, 32), (torch.float32, 80), (torch.float16, 64)]
)
def test_split_kv_decode(monkeypatch, dtype, partition_size, device):
    spy = _MergeSpy(monkeypatch)
    batch = _batch(DECODE, dtype=dtype, block_size=16, device=device)
    out = _run(batch, partition_size=partition_size)
    assert spy.calls == [-(-301 // partition_size)], "split-KV path was not taken"
    torch.testing.assert_close(out, _run(batch, paged_attention_reference), **TOL[dtype])
    torch.testing.assert_close(out, _run(batch, partition_size=0), **TOL[dtype])


def test_split_kv_mixed_batch(monkeypatch, device):
    # Partitions also work when prefill chunks share the batch (rows whose keys all fall in
    # later partitions contribute nothing there).
    spy = _MergeSpy(monkeypatch)
    batch = _batch(gqa=3, block_size=32, device=device)
    out = _run(batch, partition_size=16)
    assert spy.calls == [5]
    torch.testing.assert_close(out, _run(batch, paged_attention_reference), **TOL[torch.float32])


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_quantized_reference_matches_dense_attention(kv_dtype, device):
    batch = _batch(device=device, kv_dtype=kv_dtype)
    ref = _run(batch, paged_attention_reference)
    expected = dense_causal_attention(_dequantized(batch.logical, kv_dtype), SCALE)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)
    # ... and quantization did change the K/V (the test would not see a skipped dequantization).
    assert not torch.allclose(ref, dense_causal_attention(batch.logical, SCALE), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_quantized_kernel_matches_reference(kv_dtype, dtype, device):
    # K/V are scaled so that int8 rows have varied scales and e4m3 sees subnormals.
    logical = make_logical(
        MIXED, num_q_heads=9, num_kv_heads=3, head_dim=HEAD_DIM, dtype=dtype, device=device
    )
    # One factor per (position, head), so that shared prefixes stay equal.
    n = logical.max_seq_len * 3
    factor = torch.logspace(-2.5, 0.5, n)[
        torch.randperm(n, generator=torch.Generator().manual_seed(5))
    ]
    for x in logical.keys + logical.values:
        x *= factor.view(-1, 3, 1)[: x.shape[0]].to(x)
    batch = lay_out(logical, 16, kv_dtype=kv_dtype)
    out = _run(batch)
    assert out.dtype == dtype and out.shape == logical.query.shape
    torch.testing.assert_close(out, _run(batch, paged_attention_reference), **TOL[dtype])


@pytest.mark.parametrize("kv_dtype,partition_size", [(torch.int8, 64), (torch.float8_e4m3fn, 80)])
def test_quantized_split_kv_and_odd_shapes(monkeypatch, kv_dtype, partition_size, device):
    spy = _MergeSpy(monkeypatch)
    batch = _batch(
        DECODE, gqa=2, num_kv_heads=2, head_dim=48, block_size=32, device=device, kv_dtype=kv_dtype
    )
    out = _run(batch, partition_size=partition_size)
    assert spy.calls == [-(-301 // partition_size)], "split-KV path was not taken"
    torch.testing.assert_close(out, _run(batch, paged_attention_reference), **TOL[torch.float32])


@pytest.mark.parametrize(
    "kv_dtype,d_stored,query_dim,message",
    [
        (torch.int8, HEAD_DIM, HEAD_DIM, "query must be"),  # int8 pool without room for the scales
        (torch.int8, HEAD_DIM + 6, HEAD_DIM + 2, "multiple of 4"),  # scales not 4-byte aligned
        (torch.float8_e5m2, HEAD_DIM + 4, HEAD_DIM, "query must be"),  # fp8 pools have no scales
        (torch.uint8, HEAD_DIM, HEAD_DIM, "kv_cache dtype"),
    ],
)
def test_launcher_rejects_pool_of_no_format(kv_dtype, d_stored, query_dim, message):
    batch = _batch(MIXED[:3])
    lb = batch.logical
    pool = torch.zeros(*batch.kv_cache.shape[:-1], d_stored, dtype=kv_dtype)
    query = torch.zeros(lb.query.shape[0], lb.query.shape[1], query_dim)
    for fn in (paged_attention, paged_attention_reference):
        with pytest.raises(ValueError, match=message):
            fn(
                query,
                pool,
                1,
                batch.block_tables,
                lb.query_start_loc,
                lb.seq_lens,
                SCALE,
                lb.max_query_len,
                lb.max_seq_len,
            )


def test_quantized_pool_rejects_non_float_query():
    batch = _batch(MIXED[:3], kv_dtype=torch.int8)
    lb = batch.logical
    with pytest.raises(ValueError, match="query dtype"):
        paged_attention(
            lb.query.double(), *batch.args()[1:], SCALE, lb.max_query_len, lb.max_seq_len
        )


def test_plan_for_another_batch_is_rejected(device):
    batch = _batch(DECODE, device=device)
    lb = batch.logical
    small = _batch(DECODE[:2], device=device)
    with pytest.raises(ValueError, match="was not made for this batch"):
        paged_attention(*batch.args(), SCALE, lb.max_query_len, lb.max_seq_len, plan=_plan(small))
    too_few_partitions = dataclasses.replace(_plan(batch, partition_size=32), num_partitions=2)
    with pytest.raises(ValueError, match="was not made for this batch"):
        paged_attention(
            *batch.args(), SCALE, lb.max_query_len, lb.max_seq_len, plan=too_few_partitions
        )


def test_launch_options_in_plan(device):
    batch = _batch(DECODE, device=device)
    out = _run(batch, partition_size=64, num_warps=8, num_stages=2)
    torch.testing.assert_close(out, _run(batch, paged_attention_reference), **TOL[torch.float32])


def test_maxima_read_from_device_when_omitted(device):
    batch = _batch(MIXED[:4], device=device)
    out = paged_attention(*batch.args(), SCALE)
    torch.testing.assert_close(out, _run(batch, paged_attention_reference), **TOL[torch.float32])


def test_empty_batch(device):
    batch = _batch(MIXED[:1], device=device)
    query = batch.logical.query[:0]
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    out = paged_attention(
        query,
        batch.kv_cache,
        1,
        batch.block_tables[:0],
        torch.zeros(1, dtype=torch.int32, device=device),
        empty,
        SCALE,
        0,
        0,
    )
    assert out.shape == (0, 9, HEAD_DIM)


def test_decode_plans_launch_two_warps_except_over_int8_pools():
    cpu = torch.device("cpu")
    decode = pa.plan_paged_attention(cpu, 64, 64, 9, 3, 64, 1, 2_048)
    prefill = pa.plan_paged_attention(cpu, 512, 1, 9, 3, 64, 512, 2_048)
    assert decode.block_m == 16 and decode.num_warps == 2
    assert prefill.num_warps == 4
    assert pa.plan_paged_attention(cpu, 64, 64, 9, 3, 64, 1, 2_048, num_warps=8).num_warps == 8
    assert (
        pa.plan_paged_attention(cpu, 64, 64, 9, 3, 64, 1, 2_048, kv_dtype=torch.int8).num_warps == 4
    )


def test_auto_partition_heuristic(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(pa, "_num_sms", lambda device: 132)
    assert pa._auto_partition_size(torch.device("cpu"), 3, 100_000, 64) == 0
    # A small decode batch with long contexts is split, in tile multiples, into <= 64 parts.
    size = pa._auto_partition_size(cuda, 3, 32_768, 64)
    assert size % 64 == 0 and 2 <= -(-32_768 // size) <= pa.MAX_PARTITIONS
    assert pa._auto_partition_size(cuda, 1_000, 32_768, 64) == 0  # GPU already full
    # 64 sequences x 3 kv heads on 132 SMs: split (measured faster replayed from a graph).
    assert -(-2_048 // pa._auto_partition_size(cuda, 192, 2_048, 64)) == 3
    assert pa._auto_partition_size(cuda, 768, 1_024, 64) == 0
    assert pa._auto_partition_size(cuda, 3, 300, 64) == 0  # context too short to split


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(query=a["query"][..., :32]), "query must be"),
        (lambda a: a.update(query=a["query"].half()), "dtype"),
        (lambda a: a.update(kv_cache=a["kv_cache"][:, :, 0]), "kv_cache must be"),
        (lambda a: a.update(kv_cache=a["kv_cache"].transpose(0, 1)), "contiguous"),
        (lambda a: a.update(layer=2), "layer 2 out of range"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:-1]), "query_start_loc must be"),
        (lambda a: a.update(block_tables=a["block_tables"].float()), "int32/int64"),
        (lambda a: a.update(block_tables=a["block_tables"][:, :2]), "block table capacity"),
        (lambda a: a.update(query=a["query"][:, :8]), "multiple of num_kv_heads"),
        (
            lambda a: a.update(seq_lens=a["seq_lens"].repeat_interleave(2)[::2]),
            "seq_lens must be contiguous",
        ),
    ],
)
def test_launcher_rejects_bad_arguments(mutate, message, device):
    batch = _batch(MIXED[:3], device=device)
    lb = batch.logical
    args = dict(
        query=lb.query,
        kv_cache=batch.kv_cache,
        layer=1,
        block_tables=batch.block_tables,
        query_start_loc=lb.query_start_loc,
        seq_lens=lb.seq_lens,
        scale=SCALE,
        max_query_len=lb.max_query_len,
        max_seq_len=lb.max_seq_len,
    )
    mutate(args)
    with pytest.raises(ValueError, match=message):
        paged_attention(**args)


def _realistic_specs():
    gen = torch.Generator().manual_seed(0)
    specs = []
    for i in range(48):  # SmolLM2-135M shapes: 9 q heads, 3 kv heads, head_dim 64
        seq_len = int(torch.randint(1, 4096, (1,), generator=gen))
        q_len = 1 if i % 3 else min(seq_len, int(torch.randint(1, 512, (1,), generator=gen)))
        specs.append(SeqSpec(seq_len, q_len))
    specs.append(SeqSpec(16_384, 1))
    specs.append(SeqSpec(2048 + 100, 100, share_from=len(specs) - 1, shared_tokens=2048))
    return specs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("partition_size", [None, 0, 512])
def test_gpu_realistic_batch(dtype, partition_size):
    batch = _batch(_realistic_specs(), dtype=dtype, device="cuda")
    out = _run(batch, partition_size=partition_size)
    torch.testing.assert_close(out, _run(batch, paged_attention_reference), **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("window,cap", [(1000, None), (4096, 50.0)])
@pytest.mark.parametrize("partition_size", [None, 0, 256])
def test_gpu_window_and_soft_cap(window, cap, partition_size):
    batch = _batch(_realistic_specs(), dtype=torch.bfloat16, device="cuda")
    out = _windowed(batch=batch, window=window, cap=cap, partition_size=partition_size)
    torch.testing.assert_close(
        out,
        _windowed(paged_attention_reference, batch, window=window, cap=cap),
        **TOL[torch.bfloat16],
    )
    _poison_stale_blocks(batch, window)
    torch.testing.assert_close(
        _windowed(batch=batch, window=window, cap=cap, partition_size=partition_size),
        out,
        atol=0,
        rtol=0,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("partition_size", [None, 0])
def test_gpu_quantized_batch(kv_dtype, partition_size):
    specs = [
        SeqSpec(int(n), 1)
        for n in torch.randint(1, 4096, (32,), generator=torch.Generator().manual_seed(0))
    ]
    specs += [SeqSpec(16_384, 1), SeqSpec(700, 300)]
    batch = _batch(specs, dtype=torch.bfloat16, device="cuda", kv_dtype=kv_dtype)
    out = _run(batch, partition_size=partition_size)
    torch.testing.assert_close(out, _run(batch, paged_attention_reference), **TOL[torch.bfloat16])


def test_interpreter_detected_on_cpu():
    # The bf16 dot workaround keys on this; it must be on exactly when triton interprets.
    assert pa._INTERPRETED == (not torch.cuda.is_available())


# Sliding window (a query at p sees keys j with p - W < j <= p) and logit soft-capping.
# Windows: one key, not a multiple of the block size, exactly one block, larger than a block,
# and larger than every context (then the same as no window).
WINDOWS = (1, 7, 16, 37, 500)


def _windowed(fn=paged_attention, batch=None, *, window=None, cap=None, scale=SCALE, **plan_kw):
    lb = batch.logical
    plan = fn is paged_attention and plan_kw
    extra = {"plan": _plan(batch, sliding_window=window, **plan_kw)} if plan else {}
    return fn(
        *batch.args(),
        scale,
        lb.max_query_len,
        lb.max_seq_len,
        sliding_window=window,
        logits_soft_cap=cap,
        **extra,
    )


def _poison_stale_blocks(batch, window):
    """Point every block-table entry wholly before its sequence's window (and past its last
    block) at a NaN block, and fill every block no entry still names with NaN: what the block
    manager may leave once it releases blocks outside every window."""
    lb, table, pool = batch.logical, batch.block_tables, batch.kv_cache
    block_size = pool.shape[4]
    keep = torch.zeros(table.shape, dtype=torch.bool)
    stale = 0
    for s, spec in enumerate(lb.specs):
        first = max(0, spec.seq_len - spec.q_len - window + 1)
        keep[s, first // block_size : -(-spec.seq_len // block_size)] = True
        stale += first // block_size
    assert stale, "no block lies wholly before a window: the test would test nothing"
    live = set(table[keep.to(table.device)].tolist())
    dead = [b for b in range(pool.shape[0]) if b not in live]
    assert dead, "the layout needs a spare block"
    table[~keep.to(table.device)] = dead[0]
    pool[dead] = poison_value(pool.dtype)
    return batch


@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("window", WINDOWS)
def test_reference_window_and_soft_cap_match_dense(window, cap, device):
    batch = _batch(device=device)
    torch.testing.assert_close(
        _windowed(paged_attention_reference, batch, window=window, cap=cap),
        dense_causal_attention(batch.logical, SCALE, sliding_window=window, logits_soft_cap=cap),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize(
    "window,cap", [(1, None), (7, 1.5), (16, None), (37, 1.5), (500, None), (None, 1.5)]
)
def test_kernel_window_and_soft_cap(window, cap, device):
    batch = _batch(device=device)
    out = _windowed(batch=batch, window=window, cap=cap)
    expected = dense_causal_attention(
        batch.logical, SCALE, sliding_window=window, logits_soft_cap=cap
    )
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    if window == 500:  # wider than every context: exactly the unwindowed kernel
        torch.testing.assert_close(out, _run(batch), atol=0, rtol=0)


def test_window_and_soft_cap_change_the_result(device):
    batch = _batch(device=device)
    plain = _run(batch, paged_attention_reference)
    assert not torch.allclose(
        plain, _windowed(paged_attention_reference, batch, window=16), atol=1e-3
    )
    assert not torch.allclose(
        plain, _windowed(paged_attention_reference, batch, cap=1.5), atol=1e-3
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_window_low_precision(dtype, device):
    batch = _batch(dtype=dtype, block_size=32, device=device)
    torch.testing.assert_close(
        _windowed(batch=batch, window=24, cap=2.0),
        _windowed(paged_attention_reference, batch, window=24, cap=2.0),
        **TOL[dtype],
    )


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_kernel_window_and_soft_cap(kv_dtype, device):
    batch = _batch(device=device, kv_dtype=kv_dtype)
    out = _windowed(batch=batch, window=20, cap=3.0)
    torch.testing.assert_close(
        out, _windowed(paged_attention_reference, batch, window=20, cap=3.0), **TOL[torch.float32]
    )
    expected = dense_causal_attention(
        _dequantized(batch.logical, kv_dtype), SCALE, sliding_window=20, logits_soft_cap=3.0
    )
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize(
    "specs,window,partition_size,parts",
    [
        (DECODE, 40, 16, 3),  # partitions cover the 40-key window, not the 301-key context
        (MIXED[:4], 24, 16, 4),  # 32-query tiles (gqa 2) see up to 24 + 31 keys
    ],
)
def test_split_kv_window(monkeypatch, specs, window, partition_size, parts, device):
    spy = _MergeSpy(monkeypatch)
    batch = _batch(specs, gqa=2, num_kv_heads=2, device=device)
    out = _windowed(batch=batch, window=window, cap=2.0, partition_size=partition_size)
    assert spy.calls == [parts]
    torch.testing.assert_close(
        out,
        dense_causal_attention(batch.logical, SCALE, sliding_window=window, logits_soft_cap=2.0),
        **TOL[torch.float32],
    )


@pytest.mark.parametrize(
    "specs,window,block_size,partition_size,kv_dtype",
    [
        (MIXED, 7, 16, 0, None),
        (DECODE, 40, 16, 16, None),
        (MIXED, 20, 32, 0, torch.int8),
    ],
)
def test_blocks_before_the_window_are_never_read(
    specs, window, block_size, partition_size, kv_dtype, device
):
    batch = _batch(
        specs, gqa=2, num_kv_heads=2, block_size=block_size, device=device, kv_dtype=kv_dtype
    )
    before = {
        fn: _windowed(fn, batch, window=window, cap=2.0, partition_size=partition_size)
        for fn in (paged_attention, paged_attention_reference)
    }
    _poison_stale_blocks(batch, window)
    for fn, out in before.items():
        after = _windowed(fn, batch, window=window, cap=2.0, partition_size=partition_size)
        assert after.isfinite().all()
        torch.testing.assert_close(after, out, atol=0, rtol=0)


def test_plan_without_enough_partitions_for_the_window_is_rejected(device):
    batch = _batch(DECODE, device=device)
    lb = batch.logical
    windowed = _plan(batch, partition_size=16, sliding_window=40)
    assert windowed.num_partitions == 3
    with pytest.raises(ValueError, match="was not made for this batch"):
        paged_attention(*batch.args(), SCALE, lb.max_query_len, lb.max_seq_len, plan=windowed)
    with pytest.raises(ValueError, match="sliding_window must be"):
        _windowed(batch=batch, window=0)
    with pytest.raises(ValueError, match="logits_soft_cap must be"):
        _windowed(batch=batch, cap=0.0)
