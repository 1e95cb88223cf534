"""What the scheduler hands the model runner (SchedulerOutput) and gets back (RunnerOutput),
and its counters. The runner reads requests and never writes them: everything it computed
for a step comes back in its RunnerOutput, which `Scheduler.update_from_output` applies."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request import Request
from engine.tokens import Logprob, SampledToken

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # (request, new tokens to compute), admission order
    block_copies: list[tuple[int, int]]  # copy-on-write (src, dst) to run before the forward
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # stopped by the scheduler itself
    speculating: list[tuple[Request, int]] = field(default_factory=list)
    """Decoding requests given slots for k drafts: (request, k); `Scheduler.apply_drafts`
    sets `request.spec.drafts` (up to k) from the proposer's proposals and sizes their
    entries."""
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Request id -> its drafts' distributions ([>= len(drafts), vocab]), where the proposer
    gave them (verified by the min(1, p/q) rule)."""
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests that left since the previous step (finished, aborted): whatever the runner,
    the sampler or a proposer keeps for them by id is dropped (so are the `preempted`'s)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(slots=True)
class RunnerOutput:
    """What the model runner computed for one step, by request id."""

    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    """Requests that computed all their known tokens: one token per completion (n of them
    when a fork is due); a request that verified drafts: the tokens it keeps (accepted
    drafts, then the target's own)."""
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    """Requests asking for prompt logprobs: the entries of the prompt positions this step
    computed, next in order after those the request has."""
    pooled: dict[str, list[float]] = field(default_factory=dict)
    """Pooling requests whose prompt this step completed: the embedding."""


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens computed here (not prefix hits or remote KV)
    generation_tokens: int = 0
