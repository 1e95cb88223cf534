"""Turns logits into tokens: request masks (engine.logits_masks), penalties, temperature,
top-k, top-p, min-p, seeded draws, logprobs (from the raw logits, before any of these, as
vLLM's default `raw_logprobs`). Rows are independent of each other, so a request samples
the same token whatever else is in the batch.

Randomness for a row comes from a generator seeded by (request seed, completion index, output
position): a prefill worker sampling the first token and a decode worker sampling the rest
draw exactly what a single engine would."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.logits_masks import apply_masks
from engine.request import Request
from engine.scheduler import SampledToken

_MASK = 0xFFFF_FFFF_FFFF_FFFF


def draw_seed(seed: int, completion_index: int, position: int) -> int:
    """splitmix64 over the three numbers: well-spread 63-bit seeds for torch.Generator."""
    x = (seed * 0x9E3779B97F4A7C15 + completion_index * 0xBF58476D1CE4E5B9 + position) & _MASK
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & _MASK
    return (x ^ (x >> 31)) & 0x7FFF_FFFF_FFFF_FFFF


@dataclass(slots=True)
class SampleRow:
    """One draw: for `request`'s completion `completion_index`, at the position after its
    tokens plus `drafts` (speculative tokens taken as accepted before this position, so
    masks, penalties and the seeded draw see the history this token would follow)."""

    request: Request
    completion_index: int  # which completion this draw is for (forks draw 0..n-1)
    drafts: tuple[int, ...] = ()

    @property
    def num_output_tokens(self) -> int:
        """Output tokens before this draw: it draws output position `num_output_tokens`."""
        return self.request.num_output_tokens + len(self.drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + list(self.drafts)

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + list(self.drafts)


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.request.sampling
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and row.num_output_tokens:
            out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _filter(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p masks (to -inf), row by row settings."""
    params = [r.request.sampling for r in rows]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temps[:, None]
    if any(p.top_k for p in params):
        # By rank, not by value: exactly k tokens survive even when logits tie.
        vocab = logits.shape[-1]
        ks = torch.tensor([p.top_k or vocab for p in params], device=logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        logits = logits.scatter(1, order, sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf")))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def adjust_logits(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Request masks, then penalties, in place: what every draw sees before temperature."""
    apply_masks(logits, rows)
    _apply_penalties(logits, rows)


def row_generator(row: SampleRow, device: torch.device) -> torch.Generator:
    """The row's own random stream: seeded by (request seed, completion index, position)."""
    g = torch.Generator(device=device)
    g.manual_seed(draw_seed(row.request.seed, row.completion_index, row.num_output_tokens))
    return g


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` ([rows, vocab], unnormalized is fine) for `uniforms`
    ([rows, 1] in [0, 1)): the first index whose cdf exceeds u * total, always one with p > 0."""
    cdf = probs.cumsum(-1)
    drawn = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).squeeze(1)
    return drawn.clamp(max=probs.shape[-1] - 1)


def raw_logprobs(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], torch.Tensor | None]:
    """(rows asking for logprobs, their log-softmax before any mask or penalty)."""
    lp_idx = [i for i, r in enumerate(rows) if r.request.sampling.logprobs is not None]
    return lp_idx, (logits[lp_idx].log_softmax(-1) if lp_idx else None)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
    """One token per row. `logits`: [len(rows), vocab] fp32 (modified in place)."""
    raw = raw_logprobs(logits, rows)
    adjust_logits(logits, rows)

    greedy = [r.request.sampling.greedy for r in rows]
    tokens = logits.argmax(-1)
    random_idx = [i for i, g in enumerate(greedy) if not g]
    if random_idx:
        sub_rows = [rows[i] for i in random_idx]
        probs = _filter(logits[random_idx], sub_rows).softmax(-1)
        # Inverse CDF: one uniform per row, from that row's own (seed, index, position) stream.
        uniforms = torch.empty(len(sub_rows), 1, dtype=probs.dtype, device=probs.device)
        for j, row in enumerate(sub_rows):
            uniforms[j].uniform_(generator=row_generator(row, probs.device))
        tokens[random_idx] = inverse_cdf(probs, uniforms)
    return with_logprobs(tokens.tolist(), rows, raw)


def target_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The distribution `sample` draws each row from ([rows, vocab]): masks, penalties,
    then temperature / top-k / top-p / min-p; a point mass on the argmax for greedy rows.
    `logits` is modified in place."""
    adjust_logits(logits, rows)
    probs = torch.zeros_like(logits)
    greedy = [i for i, r in enumerate(rows) if r.request.sampling.greedy]
    random_idx = [i for i, r in enumerate(rows) if not r.request.sampling.greedy]
    if greedy:
        probs[greedy] = probs[greedy].scatter(1, logits[greedy].argmax(-1, keepdim=True), 1.0)
    if random_idx:
        probs[random_idx] = _filter(logits[random_idx], [rows[i] for i in random_idx]).softmax(-1)
    return probs


def with_logprobs(
    tokens: list[int], rows: list[SampleRow], raw: tuple[list[int], torch.Tensor | None]
) -> list[SampledToken]:
    """SampledTokens for one token per row, with logprobs (from `raw_logprobs`) where asked."""
    out = [SampledToken(token) for token in tokens]
    lp_idx, logprobs = raw
    if logprobs is None:
        return out
    chosen = logprobs.gather(1, torch.tensor([tokens[i] for i in lp_idx], device=logprobs.device)[:, None])
    ranks = token_ranks(logprobs, chosen).tolist()
    for j, (i, value) in enumerate(zip(lp_idx, chosen.squeeze(1).tolist())):
        n = rows[i].request.sampling.logprobs
        top = ()
        if n > 0:
            vals, ids = logprobs[j].topk(n)
            top = tuple(zip(ids.tolist(), vals.tolist()))
        out[i] = SampledToken(out[i].token_id, value, top, ranks[j])
    return out


def token_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """1-based rank of each row's chosen logprob ([rows, 1]) among the row's logprobs, as
    vLLM counts it: the number of tokens at least as likely (ties share the worse rank)."""
    return (logprobs >= chosen).sum(-1)
