"""Verification keeps the target's distribution: chi-square over many seeded draws on a
small vocabulary, for drafts with a distribution q (min(1, p/q) + residual) and for point
mass drafts (the target's own draw decides); a deliberately biased verifier fails the same
test, so the test can fail."""

import torch

from engine.core.request import Request
from engine.sampling.sample_row import SampleRow
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_params import SamplingParams
from engine.spec_decode.verify import accepted_prefix, rejection_sample

P = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])  # the target at the first position
Q = torch.tensor([0.10, 0.40, 0.05, 0.30, 0.10, 0.05])  # the drafter's distribution
DRAWS = 6000
CHI2_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001


def _rows(seed: int) -> list[SampleRow]:
    p = SamplingParams(temperature=1.0, seed=seed, max_tokens=8)
    r = Request(
        "r", [1, 2, 3], p, seed=seed, eos_token_ids=frozenset(), max_tokens=8, block_hashes=[]
    )
    return [SampleRow(r, 0), SampleRow(r, 0, (0,))]  # first position; the one after a draft


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _first_tokens(verify) -> torch.Tensor:
    """Histogram of the first output token over DRAWS seeds; drafts drawn from Q by a
    generator independent of the verifier's streams."""
    draft_rng = torch.Generator().manual_seed(1234)
    counts = torch.zeros(len(P))
    p2 = torch.stack([P, P])  # the second position's target (its value does not matter here)
    for seed in range(DRAWS):
        draft = int(torch.multinomial(Q, 1, generator=draft_rng))
        counts[verify(p2, draft, _rows(seed))] += 1
    return counts


def _standard(p, draft, rows):
    return rejection_sample(p, Q[None], [draft], rows)[0]


def _biased(p, draft, rows):
    """Accepts with min(1, p/q) but resamples rejections from p itself, not the residual:
    over-weights tokens the drafter under-proposes."""
    out = rejection_sample(p, Q[None], [draft], rows)
    if out[0] == draft:
        return draft
    g = torch.Generator().manual_seed(rows[0].request.seed)
    return int(torch.multinomial(p[0], 1, generator=g))


def test_rejection_sampling_preserves_the_target_distribution():
    assert _chi2(_first_tokens(_standard), P) < CHI2_DF5_P001


def test_a_biased_verifier_fails_the_same_test():
    assert _chi2(_first_tokens(_biased), P) > CHI2_DF5_P001


def test_point_mass_drafts_keep_the_target_distribution_and_accept_with_p_of_the_draft():
    """A drafter that always proposes token 1: acceptance rate p(1), outputs ~ P."""
    logits = torch.log(torch.stack([P, P]))
    counts, accepted = torch.zeros(len(P)), 0
    for seed in range(DRAWS):
        rows = _rows(seed)
        rows[1] = SampleRow(rows[0].request, 0, (1,))
        drawn = [t.token_id for t in Sampler().sample(logits.clone(), rows)]
        a = accepted_prefix(drawn, [1])
        accepted += a
        counts[drawn[0]] += 1  # the first output token is drawn[0] whether accepted or not
    assert _chi2(counts, P) < CHI2_DF5_P001
    assert abs(accepted / DRAWS - float(P[1])) < 0.03


def test_greedy_rows_accept_exactly_the_argmax():
    p = torch.zeros(3, 4)
    p[0, 2] = p[1, 0] = p[2, 3] = 1.0  # one-hot targets (greedy)
    q = torch.full((2, 4), 0.25)
    rows = [SampleRow(_rows(0)[0].request, 0, d) for d in [(), (2,), (2, 0)]]
    assert rejection_sample(p, q, [2, 0], rows) == [2, 0, 3]  # both accepted, then the bonus
    assert rejection_sample(p, q, [2, 1], rows) == [2, 0]  # the second rejected: corrected
    assert accepted_prefix([2, 0, 3], [2, 1]) == 1
