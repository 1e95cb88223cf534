"""The bf16 prefill attention kernel (engine/cpu_kernels/paged_prefill.cpp: AMX tiles, or
AVX512-BF16's vdpbf16ps where there is no AMX; `prefill_isa` says which): query rows of
several sequences (whole prompts and chunks after a cached context) over a bf16 pool, against
an fp32 reference, no further from it than the torch backend's gather + SDPA path; rows past a
sequence's end never reach the output; torch's own AMX users (SDPA, oneDNN) are unaffected by
its tile state; the backend sends prefill chunks to it and the engine's prompt logprobs match
the torch path's."""

import math
import random

import pytest
import torch

from engine import LLM, SamplingParams, cpu_kernels
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.skipif(
    not cpu_kernels.load() or not hasattr(torch.ops.pdserve_cpu, "paged_prefill"),
    reason="the prefill kernel is built only for CPUs with AVX512-BF16 (or AMX-BF16)",
)


def _case(seqs, Hq=9, Hkv=3, D=64, B=16, layers=2, spare=6, seed=0):
    """A shuffled pool holding each sequence's blocks, their tables, and query rows (a strided
    view of a fused qkv, as the model passes them)."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / B) for _, n in seqs]
    blocks = sum(need) + spare
    pool = torch.randn(blocks, Hkv, layers, 2, B, D, generator=gen).bfloat16()
    order = random.Random(seed).sample(range(blocks), blocks)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    for s, nb in enumerate(need):
        tables[s, :nb] = torch.tensor(order[:nb], dtype=torch.int32)
        order = order[nb:]
    rows = sum(q for q, _ in seqs)
    query = torch.randn(rows, Hq + 2 * Hkv, D, generator=gen).bfloat16()[:, :Hq]
    seq_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    query_lens = torch.tensor([q for q, _ in seqs], dtype=torch.int32)
    return pool, tables, query, seq_lens, query_lens


def _keys(pool, table, n, layer, kv):
    Hkv, B, D = pool.shape[1], pool.shape[4], pool.shape[5]
    blocks = pool[table[: math.ceil(n / B)].long(), :, layer, kv]  # [nb, Hkv, B, D]
    return blocks.transpose(1, 2).reshape(-1, Hkv, D)[:n]


def _reference(pool, tables, query, seqs, layer, scale):
    """fp32 causal attention of each sequence's rows over its keys."""
    out, start = [], 0
    G = query.shape[1] // pool.shape[1]
    for s, (q, n) in enumerate(seqs):
        k = _keys(pool, tables[s], n, layer, 0).float().repeat_interleave(G, 1)
        v = _keys(pool, tables[s], n, layer, 1).float().repeat_interleave(G, 1)
        scores = torch.einsum("qhd,khd->hqk", query[start : start + q].float(), k) * scale
        visible = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += q
    return torch.cat(out)


def _metadata(seqs, tables, B):
    slots = []  # this step's rows: positions n - q .. n - 1 of each sequence
    for s, (q, n) in enumerate(seqs):
        slots += [int(tables[s, p // B]) * B + p % B for p in range(n - q, n)]
    q_lens = [q for q, _ in seqs]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32
        ),
        seq_lens=torch.tensor([n for _, n in seqs], dtype=torch.int32),
        block_tables=tables,
        query_lens_cpu=q_lens,
        seq_lens_cpu=[n for _, n in seqs],
        num_decodes=sum(1 for q, _ in seqs if q == 1),
        max_query_len=max(q_lens),
        max_seq_len=max(n for _, n in seqs),
    )


def _torch_path(pool, tables, query, seqs, layer, scale):
    """The backend's gather + SDPA prefill of each sequence (cpu_kernels off)."""
    B = pool.shape[4]
    meta = _metadata(seqs, tables, B)
    out, start = [], 0
    for s, (q, _) in enumerate(seqs):
        out.append(
            TorchAttentionBackend._prefill(
                query[start : start + q], pool, layer, meta, s, scale, None, None
            )
        )
        start += q
    return torch.cat(out)


CASES = [
    [(5, 5)],
    [(16, 16)],
    [(17, 17)],
    [(256, 256)],
    [(33, 100)],  # a chunk after 67 cached tokens
    [(20, 20), (7, 300), (100, 130), (64, 64)],
]


@pytest.mark.parametrize("seqs", CASES)
@pytest.mark.parametrize(
    "Hq,Hkv,D,B", [(9, 3, 64, 16), (4, 2, 128, 32), (4, 4, 64, 16), (8, 1, 256, 16), (6, 3, 96, 16)]
)
def test_matches_the_reference(seqs, Hq, Hkv, D, B):
    pool, tables, query, seq_lens, query_lens = _case(seqs, Hq, Hkv, D, B)
    scale = D**-0.5
    ours = cpu_kernels.paged_prefill(query, pool, 1, tables, seq_lens, query_lens, scale)
    assert ours.shape == query.shape and ours.dtype == torch.bfloat16
    ref = _reference(pool, tables, query, seqs, 1, scale)
    sdpa = _torch_path(pool, tables, query, seqs, 1, scale)
    ours_err = (ours.float() - ref).abs().max().item()
    sdpa_err = (sdpa.float() - ref).abs().max().item()
    assert ours_err <= 1.5 * sdpa_err + 2e-3, (ours_err, sdpa_err)


def test_rows_past_a_sequence_end_never_reach_the_output():
    """Unused rows of the last block and every block no table names hold NaN: nothing changes
    (P is zero there, and 0 * NaN would not be)."""
    seqs = [(37, 37), (5, 50)]
    pool, tables, query, seq_lens, query_lens = _case(seqs, spare=3)
    clean = cpu_kernels.paged_prefill(query, pool, 0, tables, seq_lens, query_lens, 0.125)
    B = pool.shape[4]
    used = torch.zeros(pool.shape[0], B, dtype=torch.bool)
    for s, (_, n) in enumerate(seqs):
        for p in range(n):
            used[tables[s, p // B], p % B] = True
    poisoned = pool.clone()
    poisoned.permute(0, 3, 1, 2, 4, 5)[~used] = float("nan")
    dirty = cpu_kernels.paged_prefill(query, poisoned, 0, tables, seq_lens, query_lens, 0.125)
    assert torch.isfinite(clean.float()).all() and torch.equal(dirty, clean)


def test_refusals():
    seqs = [(8, 20)]
    pool, tables, query, seq_lens, query_lens = _case(seqs)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.paged_prefill(query, pool, 0, tables + 1000, seq_lens, query_lens, 0.125)
    with pytest.raises(RuntimeError, match="as many rows"):
        cpu_kernels.paged_prefill(query[:7], pool, 0, tables, seq_lens, query_lens, 0.125)
    with pytest.raises(RuntimeError, match="query_len in 1..seq_len"):
        cpu_kernels.paged_prefill(
            query, pool, 0, tables, torch.tensor([6], dtype=torch.int32), query_lens, 0.125
        )
    small, t8, q8, s8, l8 = _case(seqs, B=8)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_kernels.paged_prefill(q8, small, 0, t8, s8, l8, 0.125)
    assert not cpu_kernels.prefills_in_place(q8, small)
    assert not cpu_kernels.prefills_in_place(query.float(), pool)
    assert cpu_kernels.prefills_in_place(query, pool)


def test_torch_amx_users_unaffected_by_its_tile_state():
    """SDPA's CPU flash attention and oneDNN's bf16 linear (both AMX on an AMX host) before
    and after the kernel ran on the same threads: the same results."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 9, 300, 64, generator=gen).bfloat16() for _ in range(3))
    x, w = (
        torch.randn(300, 576, generator=gen).bfloat16(),
        torch.randn(960, 576, generator=gen).bfloat16(),
    )

    def torch_ops():
        return (
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
            torch.nn.functional.linear(x, w),
        )

    before = torch_ops()
    pool, tables, query, seq_lens, query_lens = _case([(300, 300)])
    for _ in range(2):
        cpu_kernels.paged_prefill(query, pool, 0, tables, seq_lens, query_lens, 0.125)
        after = torch_ops()
        assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_backend_sends_prefills_to_the_kernel(monkeypatch):
    """A step with decodes, a verify-sized chunk, whole prompts and a chunk after a cached
    context: with the kernels on, the prefill rows come from `paged_prefill` (one call) and
    agree with the kernels-off path to bf16 attention's error."""
    seqs = [(1, 40), (1, 90), (4, 60), (50, 50), (30, 130), (17, 17)]
    pool, tables, query, _, _ = _case(seqs)
    B = pool.shape[4]
    meta = _metadata(seqs, tables, B)
    # This step's K/V rows: what the pool already holds at their slots (stored over themselves).
    slots = meta.slot_mapping.tolist()
    key, value = (torch.stack([pool[s // B, :, 1, kv, s % B] for s in slots]) for kv in (0, 1))
    calls = []
    real = cpu_kernels.paged_prefill
    monkeypatch.setattr(
        cpu_kernels, "paged_prefill", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    ours = TorchAttentionBackend(cpu_kernels=True).forward(
        query, key, value, pool.clone(), 1, meta, 0.125
    )
    theirs = TorchAttentionBackend(cpu_kernels=False).forward(
        query, key, value, pool.clone(), 1, meta, 0.125
    )
    assert calls == [50 + 30 + 17]  # after the two decodes and the 4-row verify chunk
    ref = _reference(pool, tables, query, seqs, 1, 0.125)
    assert (ours.float() - ref).abs().max() <= 1.5 * (theirs.float() - ref).abs().max() + 2e-3
    assert (ours[:6].float() - ref[:6]).abs().max() < 2e-2  # decodes and the verify chunk


def test_engine_prompt_logprobs_as_close_to_fp32_as_the_torch_path(monkeypatch):
    """Teacher-forced prompt logprobs of a bf16 model (whole prompts, a chunked long one and a
    prefix-cache hit) with the kernel and with the gather + SDPA path, each against the same
    model in fp32: the kernel is no further from it."""
    prompts = [
        "The capital of France is Paris, and the capital of Italy is",
        "def add(a, b):\n    return a + b\n\n" * 12,
        "The capital of France is Paris, and the capital of Spain is",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def run(llm):
        llm.reset_prefix_cache()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return torch.tensor(
            [lp.logprob for o in outs for lp in o.prompt_logprobs if lp is not None]
        )

    def engine(dtype):
        return LLM(
            "default",
            num_layers=2,
            dtype=dtype,
            kv_cache_memory=64 << 20,
            max_num_batched_tokens=96,
            enable_prefix_caching=True,
        )

    exact = run(engine("float32"))
    bf16 = engine("bfloat16")
    calls = []
    real = cpu_kernels.paged_prefill
    monkeypatch.setattr(cpu_kernels, "paged_prefill", lambda *a: calls.append(1) or real(*a))
    ours = run(bf16)
    assert calls
    monkeypatch.setattr(cpu_kernels, "prefills_in_place", lambda *a: False)
    theirs = run(bf16)
    ours_err, theirs_err = (ours - exact).abs(), (theirs - exact).abs()
    assert ours_err.max() <= 1.5 * theirs_err.max() + 0.02, (ours_err.max(), theirs_err.max())
    assert ours_err.mean() <= 1.5 * theirs_err.mean() + 0.005, (ours_err.mean(), theirs_err.mean())
