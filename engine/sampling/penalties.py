"""Presence, frequency and repetition penalties, batched over the rows that ask for them.

`Penalties` (the sampler's) keeps each penalized request's token counts by request id: built
once from the prompt, then only the tokens appended since the previous step are folded in, so
a step costs O(new tokens) per request plus one batched pass over the penalized rows, not a
scan of the whole context (vLLM's rules: repetition over prompt + output, presence and
frequency over the output only). Counts of a request that left (finished, aborted,
preempted) are dropped by `forget`; a preempted one's are rebuilt when it samples again."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.core.request import Request
from engine.sampling.sample_row import SampleRow


@dataclass(slots=True)
class PenaltyCounts:
    """One request's token statistics over a `vocab`-wide row."""

    output_counts: torch.Tensor  # [vocab] float32: occurrences in the output tokens
    prompt_seen: torch.Tensor  # [vocab] bool: occurs in the prompt
    num_folded: int  # request.token_ids[:num_folded] are counted

    @classmethod
    def of(
        cls, request: Request, state: PenaltyCounts | None, vocab: int, device: torch.device
    ) -> PenaltyCounts:
        """`state` (the request's counts so far, or None) brought up to date with its tokens.
        Rebuilt when the token list shrank (a stop string trims trailing tokens) or the width
        changed."""
        if (
            state is None
            or state.num_folded > request.num_tokens
            or state.output_counts.shape[0] != vocab
            or state.output_counts.device != device
        ):
            prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt_seen[_ids(request.prompt_token_ids, vocab, device)] = True
            state = cls(
                torch.zeros(vocab, dtype=torch.float32, device=device),
                prompt_seen,
                request.num_prompt_tokens,
            )
        if state.num_folded < request.num_tokens:
            _count(state.output_counts, request.token_ids[state.num_folded :])
            state.num_folded = request.num_tokens
        return state


class Penalties:
    """The counts of every penalized request the sampler has seen, by request id."""

    def __init__(self) -> None:
        self.counts: dict[str, PenaltyCounts] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.counts.pop(request_id, None)

    def apply(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        """In place, on the rows whose request has a penalty; a row's drafts count as outputs
        (the history its token would follow)."""
        idx = [i for i, row in enumerate(rows) if row.request.sampling.has_penalties]
        if not idx:
            return
        vocab, device = logits.shape[-1], logits.device
        states = []
        for i in idx:
            request = rows[i].request
            state = PenaltyCounts.of(request, self.counts.get(request.request_id), vocab, device)
            self.counts[request.request_id] = state
            states.append(state)
        counts = torch.stack([s.output_counts for s in states])
        for j, i in enumerate(idx):
            if rows[i].drafts:
                _count(counts[j], rows[i].drafts)
        params = [rows[i].request.sampling for i in idx]
        column = lambda values: torch.tensor(values, dtype=logits.dtype, device=device)[:, None]  # noqa: E731
        whole = len(idx) == len(rows)
        sub = logits if whole else logits[idx]
        if any(p.repetition_penalty != 1.0 for p in params):
            rep = column([p.repetition_penalty for p in params])
            seen = torch.stack([s.prompt_seen for s in states]) | (counts > 0)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            present = (counts > 0).to(logits.dtype)
            sub = (
                sub
                - column([p.frequency_penalty for p in params]) * counts
                - column([p.presence_penalty for p in params]) * present
            )
        if whole:
            logits.copy_(sub)
        else:
            logits[idx] = sub


def _ids(tokens: list[int] | tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    return ids[(ids >= 0) & (ids < vocab)]  # an id outside the row can never be sampled


def _count(row: torch.Tensor, tokens: list[int] | tuple[int, ...]) -> None:
    ids = _ids(tokens, row.shape[0], row.device)
    row.index_put_(
        (ids,), torch.ones(len(ids), dtype=row.dtype, device=row.device), accumulate=True
    )
