"""The C++ paged decode kernel (engine/cpu_kernels) against the torch backend's
gather + SDPA decode path: ragged contexts over shuffled blocks, block sizes 16 and 32, GQA
groups, a head_dim that is not a multiple of 16, sliding windows, soft-capping, bf16, and
quantized pools (fp8 e4m3 / e5m2, int8 with per-row scales) read in place."""

import pytest
import torch

from engine import cpu_kernels
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kv.kv_format import quantize

pytestmark = pytest.mark.skipif(
    not cpu_kernels.load(), reason="no C++ toolchain for the CPU kernels"
)


def _decode_batch(
    seq_lens, block_size, num_q_heads, num_kv_heads, head_dim, dtype, layers=3, seed=0
):
    """A pool with each sequence's blocks scattered at random, and its metadata."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    pool = torch.randn(num_blocks, num_kv_heads, layers, 2, block_size, head_dim, generator=gen).to(
        dtype
    )
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    for s, nb in enumerate(per_seq):
        tables[s, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    query = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=list(seq_lens),
        num_decodes=len(seq_lens),
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )
    return query, pool, md


CASES = [  # seq_lens, block_size, q heads, kv heads, head_dim
    ([1, 17, 300, 64, 1000], 16, 9, 3, 64),
    ([5, 33, 129], 32, 4, 4, 64),
    ([70, 2, 511], 16, 8, 2, 40),
    (
        [3, 29, 66, 7],
        7,
        6,
        2,
        32,
    ),  # a block size no multiple of 4: key groups stop at each block's end
    ([1, 2, 9, 40], 1, 2, 1, 128),
]


@pytest.mark.parametrize(
    "window,cap", [(None, None), (1, None), (24, None), (None, 30.0), (50, 2.0)]
)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_gather_path(case, window, cap, dtype):
    seq_lens, block_size, hq, hkv, d = case
    query, pool, md = _decode_batch(seq_lens, block_size, hq, hkv, d, dtype)
    scale = d**-0.5
    ref = TorchAttentionBackend._decode(query, pool, 1, md, scale, window, cap)
    out = cpu_kernels.paged_decode(query, pool, 1, md.block_tables, md.seq_lens, scale, window, cap)
    assert out.dtype == dtype and out.shape == query.shape
    tol = dict(atol=2e-6, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_strided_query_view_and_backend_routing():
    """The backend hands the kernel q as a view of the fused qkv output; only decode rows
    go to it, and its result equals the gather path's."""
    query, pool, md = _decode_batch([40, 7, 100], 16, 9, 3, 64, torch.float32)
    qkv = torch.cat([query.flatten(1), torch.randn(3, 2 * 3 * 64)], dim=1)
    q = qkv[:, : 9 * 64].view(3, 9, 64)
    k = v = torch.randn(3, 3, 64)
    md.slot_mapping = torch.tensor([-1, -1, -1])  # nothing stored: the pool stays as built
    on = TorchAttentionBackend().forward(q, k, v, pool, 0, md, 0.125)
    off = TorchAttentionBackend(cpu_kernels=False).forward(q, k, v, pool, 0, md, 0.125)
    torch.testing.assert_close(on, off, atol=2e-6, rtol=2e-5)


QUANTIZED = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("storage", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_pool_matches_the_dequantizing_gather_path(case, storage, dtype):
    seq_lens, block_size, hq, hkv, d = case
    query, pool, md = _decode_batch(seq_lens, block_size, hq, hkv, d, dtype)
    stored = quantize(pool, storage)
    assert cpu_kernels.fits(query, stored)
    for window, cap in [(None, None), (24, 2.0)]:
        ref = TorchAttentionBackend._decode(query, stored, 1, md, d**-0.5, window, cap)
        out = cpu_kernels.paged_decode(
            query, stored, 1, md.block_tables, md.seq_lens, d**-0.5, window, cap
        )
        assert out.dtype == dtype and out.shape == query.shape
        # The gather path rounds dequantized values to the query's dtype; the kernel keeps fp32.
        tol = dict(atol=2e-5, rtol=2e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_backend_sends_quantized_decodes_to_the_kernel():
    query, pool, md = _decode_batch([40, 7, 100], 16, 9, 3, 64, torch.bfloat16)
    stored = quantize(pool, torch.int8)
    k = v = torch.randn(3, 3, 64).to(torch.bfloat16)
    md.slot_mapping = torch.tensor([-1, -1, -1])
    on = TorchAttentionBackend().forward(query, k, v, stored, 0, md, 0.125)
    off = TorchAttentionBackend(cpu_kernels=False).forward(query, k, v, stored, 0, md, 0.125)
    torch.testing.assert_close(on.float(), off.float(), atol=1e-2, rtol=1e-2)


def test_fits_checks_the_stored_head_size():
    query, pool, md = _decode_batch([40, 7], 16, 4, 2, 64, torch.float32)
    assert cpu_kernels.fits(query, pool.to(torch.float8_e4m3fn))
    assert cpu_kernels.fits(query, quantize(pool, torch.int8))  # head_dim + 4 scale bytes
    assert not cpu_kernels.fits(query, pool.to(torch.int8))  # no room for the scales
    assert not cpu_kernels.fits(query, pool.to(torch.bfloat16))  # another float dtype
    with pytest.raises(RuntimeError, match="head_dim"):
        cpu_kernels.paged_decode(query, pool.to(torch.int8), 0, md.block_tables, md.seq_lens, 0.125)


def test_a_block_id_outside_the_pool_raises():
    query, pool, md = _decode_batch([40, 7], 16, 4, 2, 64, torch.float32)
    md.block_tables[1, 0] = pool.shape[0] + 2
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.paged_decode(query, pool, 0, md.block_tables, md.seq_lens, 0.125)


def test_same_bits_at_any_thread_count():
    """Each (sequence, kv head) is one thread's work: no reduction across threads."""
    query, pool, md = _decode_batch([900, 3, 250, 64, 511, 17, 128], 16, 9, 3, 64, torch.float32)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(
                cpu_kernels.paged_decode(query, pool, 0, md.block_tables, md.seq_lens, 0.125)
            )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
