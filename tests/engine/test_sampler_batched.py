"""The sampler's batched pieces against plain references: the chunked argmax and inverse CDF
(torch.argmax / a float64 full-vocabulary cdf), the counter-based uniforms, and the
incrementally maintained penalty counts (a from-scratch count of the whole context)."""

import itertools

import numpy as np
import pytest
import torch

from engine import cpu_kernels
from engine.core.request import Request
from engine.sampling.penalties import Penalties
from engine.sampling.sample_row import SampleRow
from engine.sampling.sampler import (
    Sampler,
    argmax_rows,
    chunk_totals,
    inverse_cdf,
    row_uniforms,
    softmax_,
)
from engine.sampling.sampling_params import SamplingParams

_ids = itertools.count()


def _row(params: SamplingParams, output=(), prompt=(3,), seed=0, index=0, drafts=()) -> SampleRow:
    r = Request(
        f"r{next(_ids)}",
        list(prompt),
        params,
        seed=seed,
        eos_token_ids=frozenset(),
        max_tokens=64,
        block_hashes=[],
    )
    for t in output:
        r.append_token(t)
    return SampleRow(r, index, tuple(drafts))


@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152, 49155])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "torch"])
def test_argmax_rows_is_torch_argmax_including_ties_masks_and_nans(vocab, kernels, monkeypatch):
    if kernels and not cpu_kernels.load():
        pytest.skip("no C++ toolchain for the CPU kernels")
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(11, vocab, generator=g)
    x[1] = 0.0  # all tied: the first index
    x[2, vocab // 2 :] = float("-inf")
    x[3, -1] = 50.0  # the maximum in the tail chunk
    x[4] = float("-inf")
    x[4, vocab - 1] = 1.0
    x[5, [0, vocab - 1]] = 99.0  # a tie between the first and the last chunk
    x[6] = float("-inf")  # nothing allowed: index 0
    x[7, [vocab // 2, vocab - 1]] = float("nan")  # a NaN wins, the first one
    x[8, vocab - 1] = float("nan")
    x[8, 0] = float("inf")
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist()
    wide = torch.randn(4, vocab + 3, generator=g, dtype=torch.bfloat16)[:, :vocab]  # strided rows
    assert argmax_rows(wide).tolist() == wide.float().argmax(-1).tolist()


def _reference_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    cdf = probs.double().cumsum(-1)
    return [
        int(torch.searchsorted(c, ui.double() * c[-1], right=True).clamp(max=len(c) - 1))
        for c, ui in zip(cdf, u)
    ]


@pytest.mark.parametrize("vocab", [5, 300, 49152, 4099])
def test_inverse_cdf_matches_the_full_cdf_and_never_draws_a_zero(vocab):
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(64, vocab, generator=g) ** 4
    probs[0, vocab // 3 :] = 0.0  # mass only at the start
    probs[1, : vocab - 1] = 0.0  # a single token: the very last
    probs[2, ::2] = 0.0
    u = torch.rand(64, 1, generator=g)
    u[3] = 0.0
    u[4] = 1.0 - 2**-24  # rounds up to u * total == total in float32
    drawn = inverse_cdf(probs, u).tolist()
    assert all(probs[i, t] > 0 for i, t in enumerate(drawn))
    reference = _reference_inverse_cdf(probs, u)
    # Summation order differs (chunk totals vs one running sum): a draw may move only across a
    # boundary the rounding straddles, i.e. to a neighbouring positive token.
    mismatched = [i for i, (a, b) in enumerate(zip(drawn, reference)) if a != b]
    assert len(mismatched) <= 2, mismatched
    assert drawn[1] == vocab - 1 and drawn[3] == int((probs[3] > 0).nonzero()[0])


def test_inverse_cdf_follows_the_distribution():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3] + [0.0] * 600])
    u = torch.from_numpy((np.arange(10_000) + 0.5) / 10_000)[:, None]
    drawn = inverse_cdf(probs.expand(10_000, -1).contiguous(), u)
    freq = torch.bincount(drawn, minlength=4)[:4].double() / 10_000
    assert torch.allclose(freq, torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64), atol=1e-3)


def test_row_uniforms_depend_only_on_seed_index_and_position():
    params = SamplingParams(temperature=1.0)
    rows = [
        _row(params, seed=s, index=i, output=[1] * p)
        for s in (0, 7)
        for i in (0, 1)
        for p in (0, 3)
    ]
    together = row_uniforms(rows, 2)
    alone = np.concatenate([row_uniforms([r], 2) for r in rows])
    assert np.array_equal(together, alone)
    assert np.array_equal(row_uniforms(rows)[:, 0], together[:, 0])  # the first of a row's stream
    assert len({float(u) for u in together.ravel()}) == together.size
    # A draft counts as an output position: the row after one draft draws position 1.
    assert (
        row_uniforms([_row(params, drafts=(5,))])[0, 0]
        == row_uniforms([_row(params, output=[9])])[0, 0]
    )
    many = row_uniforms([_row(params, seed=3, output=[1] * p) for p in range(4000)])
    assert ((many >= 0) & (many < 1)).all() and abs(many.mean() - 0.5) < 0.02
    assert abs(np.histogram(many, bins=10, range=(0, 1))[0] / 4000 - 0.1).max() < 0.03


def _from_scratch(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """The penalties' definition, recomputed over the row's whole history."""
    p, out = row.request.sampling, logits.clone()
    seen = sorted(set(row.token_ids))
    vals = out[seen]
    out[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    counts = torch.bincount(
        torch.tensor(row.output_token_ids, dtype=torch.long), minlength=len(out)
    ).float()
    return out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def test_incremental_penalty_counts_equal_a_count_of_the_whole_context():
    vocab = 50
    g = torch.Generator().manual_seed(0)
    penalized = SamplingParams(
        temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2
    )
    plain = SamplingParams(temperature=1.0)
    rows = [_row(penalized, prompt=[1, 2, 2, 40]), _row(plain), _row(penalized, prompt=[7])]
    penalties = Penalties()
    for step in range(6):
        for k, row in enumerate(rows):
            row.request.append_token(
                int(torch.randint(vocab, (1,), generator=g)) if step else 2 + k
            )
        if step == 4:  # a stop string trims the last tokens: the counts are rebuilt
            del rows[0].request.token_ids[-2:]
        logits = torch.randn(len(rows), vocab, generator=g)
        expected = torch.stack(
            [_from_scratch(logits[0], rows[0]), logits[1], _from_scratch(logits[2], rows[2])]
        )
        penalties.apply(logits, rows)
        assert torch.allclose(logits, expected, atol=1e-6), step
    assert rows[1].request.request_id not in penalties.counts  # no penalty: no counts kept
    with_drafts = SampleRow(rows[2].request, 0, (4, 4, 9))
    logits = torch.randn(1, vocab, generator=g)
    expected = _from_scratch(logits[0], with_drafts)
    penalties.apply(logits, [with_drafts])
    assert torch.allclose(logits[0], expected, atol=1e-6)


def test_mixed_batch_rows_sample_as_they_would_alone():
    """Greedy, random, filtered and penalized rows in one call draw what each draws alone."""
    g = torch.Generator().manual_seed(1)
    rows = [
        _row(SamplingParams(temperature=0.0), seed=1),
        _row(SamplingParams(temperature=0.7), seed=2),
        _row(SamplingParams(temperature=1.0, top_k=20, top_p=0.9), seed=3),
        _row(
            SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.5),
            seed=4,
            output=[5, 6],
        ),
        _row(SamplingParams(temperature=1.0), seed=5, index=2),
    ]
    logits = torch.randn(len(rows), 4099, generator=g)
    together = [t.token_id for t in Sampler().sample(logits.clone(), rows)]
    alone = [
        Sampler().sample(logits[i : i + 1].clone(), [row])[0].token_id for i, row in enumerate(rows)
    ]
    assert together == alone
    assert together[0] == int(logits[0].argmax())


@pytest.mark.parametrize("shape", [(64, 49152), (1, 7), (3, 4099)])
def test_softmax_in_place_is_bit_identical_to_softmax(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 5
    expected = x.softmax(-1)
    assert torch.equal(softmax_(x), expected) and torch.equal(x, expected)


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ toolchain for the CPU kernels")
@pytest.mark.parametrize("vocab", [7, 256, 4099, 49152])
def test_exp_chunk_totals_is_the_softmax_numerators_and_their_chunk_sums(vocab):
    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(6, vocab + 5, generator=g) * 4
    wide[2, : vocab // 2] = float("-inf")  # masked tokens: exp gives 0
    x = wide[:, :vocab]  # rows of a strided view (unit last stride)
    past = wide[:, vocab:].clone()
    expected = (x - x.amax(-1, keepdim=True)).exp()
    totals = cpu_kernels.exp_chunk_totals_(x, 256)
    torch.testing.assert_close(x, expected, atol=0, rtol=2e-6)
    torch.testing.assert_close(totals, chunk_totals(expected), atol=1e-6, rtol=2e-6)
    assert totals.shape == (6, -(-vocab // 256)) and (x[2, : vocab // 2] == 0).all()
    assert torch.equal(wide[:, vocab:], past)  # columns past the view untouched
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.exp_chunk_totals_(torch.zeros(2, 8, dtype=torch.bfloat16), 4)


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ toolchain for the CPU kernels")
def test_exp_chunk_totals_exp_across_its_range():
    """The pass's fast exp (vec16.h `fast_exp16`): within 2e-7 relative of exp on [-87, 0],
    exactly 0 below -87 and for -inf; NaN stays NaN, and a row of -inf becomes NaN as torch's
    softmax makes it."""
    x = torch.linspace(-95.0, 0.0, 1_000_003)
    x[-1] = 0.0  # the row max
    x[::97] = float("-inf")
    row = x[None, :].clone()
    cpu_kernels.exp_chunk_totals_(row, 256)
    exact = torch.exp(x.double())
    inside = x >= -87
    rel = ((row[0].double() - exact).abs() / exact)[inside]
    assert rel.max() < 2e-7
    assert (row[0][~inside] == 0).all()
    odd = torch.tensor([[0.0, float("nan"), -1.0] + [0.0] * 30, [float("-inf")] * 33])
    cpu_kernels.exp_chunk_totals_(odd, 16)
    assert odd[0, 1].isnan() and odd[0, 0] == 1.0 and odd[1].isnan().all()


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ toolchain for the CPU kernels")
@pytest.mark.parametrize("vocab", [7, 256, 4099, 49152])
def test_sample_rows_draws_inverse_cdf_over_the_numerators_and_leaves_the_logits(vocab):
    """One C++ pass (sums, then the draw, the landing chunk's numerators recomputed) draws
    exactly the token `inverse_cdf` draws from `exp_chunk_totals_`'s numerators and sums, for
    masked rows, a single surviving token, u = 0 and u that rounds up to the total; the
    logits are not written."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(64, vocab, generator=g) * 4
    x[0, vocab // 3 :] = float("-inf")  # mass only at the start
    x[1, : vocab - 1] = float("-inf")  # a single token: the very last
    x[2, ::2] = float("-inf")
    u = torch.rand(64, 1, generator=g)
    u[3] = 0.0
    u[4] = 1.0 - 2**-24
    before = x.clone()
    drawn = cpu_kernels.sample_rows(x, u.reshape(-1), None, 256)
    assert torch.equal(x, before)
    numerators = x.clone()
    totals = cpu_kernels.exp_chunk_totals_(numerators, 256)
    assert drawn.tolist() == inverse_cdf(numerators, u, totals).tolist()
    assert all(x[i, t] > float("-inf") for i, t in enumerate(drawn.tolist()))
    assert drawn[1] == vocab - 1
    with pytest.raises(RuntimeError, match="uniforms"):
        cpu_kernels.sample_rows(x, u.double().reshape(-1), None, 256)
    with pytest.raises(RuntimeError, match="temperatures"):
        cpu_kernels.sample_rows(x, u.reshape(-1), torch.ones(3), 256)


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ toolchain for the CPU kernels")
@pytest.mark.parametrize("vocab", [7, 4099, 49152])
def test_sample_rows_temperatures_and_bf16_logits(vocab):
    """A row's temperature t draws what the row divided by t (torch's fp32 division) draws,
    t = 0 takes the argmax; bf16 logits draw what their fp32 widening draws."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(32, vocab, generator=g) * 4).bfloat16()
    x[5, : vocab - 1] = float("-inf")
    u = torch.rand(32, generator=g)
    t = torch.tensor([0.0, 1.0, 0.7, 1.3, 1e-3, 2.0, 0.0, 0.25] * 4)
    wide = x.float()
    drawn = cpu_kernels.sample_rows(x, u, t, 256).tolist()
    assert drawn == cpu_kernels.sample_rows(wide, u, t, 256).tolist()
    drawing = t > 0
    divided = wide[drawing] / t[drawing, None]
    assert [d for d, keep in zip(drawn, drawing) if keep] == cpu_kernels.sample_rows(
        divided, u[drawing].contiguous(), None, 256
    ).tolist()
    assert [d for d, keep in zip(drawn, drawing) if not keep] == wide[~drawing].argmax(-1).tolist()
    assert drawn[5] == vocab - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_rows_draw_the_same_tokens_with_and_without_the_kernels(dtype, monkeypatch):
    """Greedy and tempered rows (all drawing plainly: one kernel call over the logits as
    given) and the fallback (fp32 copy, in-place temperature, softmax + inverse CDF) give the
    same tokens, bf16 logits included."""
    logits = (torch.randn(64, 49152, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    rows = [
        _row(SamplingParams(temperature=(0.8, 0.0, 1.0, 1.7)[i % 4]), seed=i, output=range(i % 5))
        for i in range(64)
    ]
    sampler = Sampler()
    assert sampler.reads_head_logits(rows, logits.device) == cpu_kernels.load()
    fast = [t.token_id for t in sampler.sample(logits.clone(), rows)]
    monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    plain = [t.token_id for t in Sampler().sample(logits.clone(), rows)]
    assert fast == plain


def test_rows_that_need_the_logits_widened_are_not_drawn_plainly():
    """Logprobs, masks, penalties and the filters read or rewrite fp32 logits: a batch with
    any such row keeps the fp32 path."""
    sampler = Sampler()
    cpu = torch.device("cpu")
    plain = _row(SamplingParams(temperature=0.5))
    for params in (
        SamplingParams(logprobs=1),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.1),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(logit_bias={1: 2.0}),
        SamplingParams(allowed_token_ids=[1, 2]),
        SamplingParams(min_tokens=2),
        SamplingParams(repetition_penalty=1.1),
    ):
        assert not sampler.reads_head_logits([plain, _row(params)], cpu), params
    banned = _row(SamplingParams())
    banned.request.bad_words_token_ids = [[4]]
    assert not sampler.reads_head_logits([plain, banned], cpu)
    past_min_tokens = _row(SamplingParams(min_tokens=2), output=(5, 6))
    assert sampler.reads_head_logits([plain, past_min_tokens], cpu) == cpu_kernels.load()
    assert not sampler.reads_head_logits([plain], torch.device("meta"))
