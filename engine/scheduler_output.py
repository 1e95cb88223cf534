"""What the scheduler hands the model runner and gets back, and its counters."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # (request, new tokens to compute), admission order
    block_copies: list[tuple[int, int]]  # copy-on-write (src, dst) to run before the forward
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # stopped by the scheduler itself
    speculating: list[tuple[Request, int]] = field(default_factory=list)
    """Decoding requests given slots for k drafts: (request, k); the proposer fills
    `request.spec.drafts` (up to k), then `Scheduler.fit_drafts` sizes their entries."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens computed here (not prefix hits or remote KV)
    generation_tokens: int = 0
