"""Per-request logit masks, applied before penalties and temperature (vLLM's order):
allowed_token_ids, bad_words, min_tokens, logit_bias, then the structured-output grammar.

A row pays for these only when its request asks for one of them (`needs_masks`); a batch
where no row does costs one attribute check per row."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.sampling.sample_row import SampleRow

if TYPE_CHECKING:
    from engine.structured.state import GrammarState

_NEG_INF = float("-inf")


def needs_masks(row: SampleRow) -> bool:
    p = row.request.sampling
    return bool(
        p.allowed_token_ids is not None
        or row.request.bad_words_token_ids
        or p.logit_bias
        or row.num_output_tokens < p.min_tokens
    )


def apply_grammar_masks(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Structured outputs: rows of constrained requests keep only the tokens their grammar
    allows next (after the row's drafts, for a speculating sequence), once their reasoning
    has ended. One batched bitmask."""
    constrained = [i for i, row in enumerate(rows) if row.request.grammar is not None]
    if not constrained:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    applied = [i for i in constrained if _grammar(rows[i]).fill_mask(bitmask, i, rows[i].drafts)]
    if applied:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=applied)


def banned_bad_word_tokens(bad_words_token_ids: list[list[int]], output: list[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens end `output` (one-token words always)."""
    banned = []
    for word in bad_words_token_ids:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or output[-prefix:] == word[:-1]:
            banned.append(word[-1])
    return banned


def min_tokens_banned(row: SampleRow, vocab_size: int) -> list[int]:
    """While fewer than min_tokens are out: every EOS id and every stop token id (those in
    the vocabulary: a stop id outside it can never be sampled anyway)."""
    request = row.request
    if row.num_output_tokens >= request.sampling.min_tokens:
        return []
    ids = request.eos_token_ids | set(request.sampling.stop_token_ids)
    return sorted(t for t in ids if 0 <= t < vocab_size)


def apply_masks(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place, row by row, only for rows whose request needs it; grammar masks last."""
    _apply_request_masks(logits, rows)
    apply_grammar_masks(logits, rows)


def _apply_request_masks(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    device = logits.device
    ids = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    for i, row in enumerate(rows):
        if not needs_masks(row):
            continue
        req, p = row.request, row.request.sampling
        if p.allowed_token_ids is not None:
            allowed = ids(p.allowed_token_ids)
            kept = logits[i, allowed]
            logits[i] = _NEG_INF
            logits[i, allowed] = kept
        banned = min_tokens_banned(row, logits.shape[-1])
        if req.bad_words_token_ids:
            banned += banned_bad_word_tokens(req.bad_words_token_ids, row.output_token_ids)
        if banned:
            logits[i, ids(banned)] = _NEG_INF
        if p.logit_bias:
            logits[i].index_add_(
                0,
                ids(list(p.logit_bias)),
                torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=device),
            )


def _grammar(row: SampleRow) -> GrammarState:
    """A constrained row's grammar (`constrained` holds only rows with one)."""
    assert row.request.grammar is not None
    return row.request.grammar
