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
    request: Request
    completion_index: int  # which completion this draw is for (forks draw 0..n-1)


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.request.sampling
        if not p.has_penalties:
            continue
        req = row.request
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and req.num_output_tokens:
            out = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
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


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
    """One token per row. `logits`: [len(rows), vocab] fp32 (modified in place)."""
    lp_idx = [i for i, r in enumerate(rows) if r.request.sampling.logprobs is not None]
    raw_logprobs = logits[lp_idx].log_softmax(-1) if lp_idx else None
    apply_masks(logits, rows)
    _apply_penalties(logits, rows)

    greedy = [r.request.sampling.greedy for r in rows]
    tokens = logits.argmax(-1)
    random_idx = [i for i, g in enumerate(greedy) if not g]
    if random_idx:
        sub_rows = [rows[i] for i in random_idx]
        probs = _filter(logits[random_idx], sub_rows).softmax(-1)
        # Inverse CDF: one uniform per row, from that row's own (seed, index, position) stream.
        uniforms = torch.empty(len(sub_rows), 1, dtype=probs.dtype, device=probs.device)
        g = torch.Generator(device=probs.device)
        for j, row in enumerate(sub_rows):
            req = row.request
            g.manual_seed(draw_seed(req.seed, row.completion_index, req.num_output_tokens))
            uniforms[j].uniform_(generator=g)
        cdf = probs.cumsum(-1)
        # right: the first index whose cdf exceeds u * total — always a token with p > 0.
        drawn = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).squeeze(1)
        tokens[random_idx] = drawn.clamp(max=probs.shape[-1] - 1)

    out = [SampledToken(token) for token in tokens.tolist()]
    if raw_logprobs is None:
        return out
    chosen = raw_logprobs.gather(1, tokens[lp_idx, None])
    ranks = token_ranks(raw_logprobs, chosen).tolist()
    for j, (i, value) in enumerate(zip(lp_idx, chosen.squeeze(1).tolist())):
        n = rows[i].request.sampling.logprobs
        top = ()
        if n > 0:
            vals, ids = raw_logprobs[j].topk(n)
            top = tuple(zip(ids.tolist(), vals.tolist()))
        out[i] = SampledToken(out[i].token_id, value, top, ranks[j])
    return out


def token_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """1-based rank of each row's chosen logprob ([rows, 1]) among the row's logprobs, as
    vLLM counts it: the number of tokens at least as likely (ties share the worse rank)."""
    return (logprobs >= chosen).sum(-1)
