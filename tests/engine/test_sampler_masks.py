"""The sampler's per-request masks on hand-built logits: allowed_token_ids, bad_words,
min_tokens, logit_bias, and the rank of the sampled token's logprob."""

import math

import torch

from engine.core.request import Request
from engine.sampling.sample_row import SampleRow
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_params import SamplingParams

EOS, STOP = 2, 3
# Token 0 is the clear favourite, then 1, 2 (eos), 3, ... 7.
LOGITS = torch.tensor([[4.0, 3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0]])


def sample(logits, rows):
    return Sampler().sample(logits, rows)


def _row(output=(), bad_words=(), **params) -> SampleRow:
    p = SamplingParams(max_tokens=20, **{"temperature": 0.0, **params})
    r = Request(
        "r",
        [7, 7],
        p,
        seed=p.seed or 0,
        eos_token_ids=frozenset({EOS}),
        max_tokens=20,
        block_hashes=[],
        bad_words_token_ids=[list(w) for w in bad_words],
    )
    for t in output:
        r.append_token(t)
    return SampleRow(r, 0)


def _greedy(row, logits=LOGITS):
    return sample(logits.clone(), [row])[0].token_id


def _drawn(row_factory, seeds=200):
    """Every token drawn at temperature 1 over many seeds."""
    return {sample(LOGITS.clone(), [row_factory(seed)])[0].token_id for seed in range(seeds)}


def test_allowed_token_ids_mask_everything_else():
    assert _greedy(_row(allowed_token_ids=(4, 6))) == 4
    assert _drawn(lambda s: _row(allowed_token_ids=(4, 6), temperature=1.0, seed=s)) == {4, 6}


def test_bad_words_mask_the_token_that_would_complete_one():
    words = [(5, 0), (1,)]  # two tokens: 0 after 5; one token: 1 always
    assert _greedy(_row(output=[5], bad_words=words)) == EOS  # 0 and 1 both masked
    assert _greedy(_row(output=[4], bad_words=words)) == 0  # 0 is fine after 4
    assert _greedy(_row(output=[], bad_words=words)) == 0  # and as the first token
    assert 1 not in _drawn(lambda s: _row(bad_words=words, temperature=1.0, seed=s))
    # A bad word longer than the output so far cannot be completed yet.
    assert _greedy(_row(output=[5], bad_words=[(6, 5, 0)])) == 0


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 7.0, 0.0, 0.0, 0.0]])  # eos, then stop id
    for out_len, expected in [(0, 4), (2, 4), (3, EOS)]:
        row = _row(output=[5] * out_len, min_tokens=3, stop_token_ids=(STOP,))
        assert _greedy(row, logits) == expected, out_len
    # stop_token_ids masked too: with eos allowed to win only once min_tokens is out.
    row = _row(output=[], min_tokens=1, stop_token_ids=(STOP, 99, -1))  # out of vocab: ignored
    assert _greedy(row, torch.tensor([[0.0, 0.0, 0.0, 9.0, 7.0, 0.0, 0.0, 8.0]])) == 7


def test_logit_bias_adds_to_logits():
    assert _greedy(_row(logit_bias={7: 100.0})) == 7
    assert _greedy(_row(logit_bias={0: -100.0})) == 1
    assert _greedy(_row(logit_bias={1: 0.99})) == 0 and _greedy(_row(logit_bias={1: 1.01})) == 1


def test_rows_without_masks_are_untouched_in_a_mixed_batch():
    rows = [_row(logit_bias={7: 100.0}), _row(), _row(allowed_token_ids=(5,))]
    assert [t.token_id for t in sample(LOGITS.repeat(3, 1), rows)] == [7, 0, 5]


def test_logprobs_and_rank_come_from_the_raw_logits():
    raw = torch.log_softmax(LOGITS[0], -1)
    for allowed, rank in [((0,), 1), ((3, 6), 4), ((7,), 8)]:
        token = sample(LOGITS.clone(), [_row(allowed_token_ids=allowed, logprobs=2)])[0]
        assert token.token_id == allowed[0]
        assert token.rank == rank
        assert math.isclose(token.logprob, raw[allowed[0]].item(), abs_tol=1e-6)
        assert [t for t, _ in token.top_logprobs] == [0, 1]  # unmasked top 2
    # Ties: vLLM counts every token at least as likely (the sampled one included).
    tied = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert sample(tied, [_row(logprobs=0)])[0].rank == 3
