"""What a proposer is: given sequences about to be verified, draft up to k tokens each.

    propose([(request, k), ...]) -> [Proposal, ...]   (same order)

Each request is decoding (its last token not yet computed) and has KV slots for k + 1 more
positions, allocated by the scheduler: a proposer that runs a model may write its own KV
for positions num_tokens - 1 .. num_tokens + k - 2 (the target's verify pass writes them
again). A Proposal may hold fewer than k tokens (none: the sequence just decodes).

`Proposal.probs` ([len(token_ids), vocab]): the distribution each token was drawn from. Set,
the verifier uses the standard accept-with-min(1, p/q) rule and resamples rejections from
the normalized residual; None means each draft is a point mass (a greedy or lookup drafter),
where that rule is exactly "accept while the target's own seeded draw equals the draft"
(engine/spec_decode/verify.py). The built-in proposers (ngram, draft_model, self:N) draft
greedily; EAGLE/Medusa-style heads plug in here and may return probabilities.

`Proposal.num_draft_computed`: a proposer with a KV pool of its own says how far the
sequence's draft KV now reaches (`SpecState.num_draft_computed`, where it catches up from
next time). A proposer reads requests and never writes them: the scheduler applies its
proposals (`SchedulerOutput.with_drafts`, then `Scheduler.update_from_output`).

`copy_blocks(copies)`: copy-on-write block copies the scheduler issued this step, for a
proposer that keeps KV of its own indexed by the target's block ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.core.request import Request


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None = None
    num_draft_computed: int | None = None  # None: no KV of its own


class Proposer(Protocol):
    def propose(self, batch: list[tuple[Request, int]]) -> list[Proposal]: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...
