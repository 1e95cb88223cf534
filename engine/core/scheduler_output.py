"""What the scheduler hands the model runner (SchedulerOutput) and gets back (RunnerOutput),
and its counters. The runner reads requests and never writes them: everything it computed
for a step comes back in its RunnerOutput, which `Scheduler.update_from_output` applies."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.core.request import Request
from engine.processing.tokens import Logprob, SampledToken

if TYPE_CHECKING:
    from engine.spec_decode.proposer import Proposal


@dataclass(frozen=True, slots=True)
class StepInput:
    """What whoever drives the engine hands one step (`LLMEngine.step`) besides the queues."""

    prompt_token_budget: int = 0
    """Most tokens all prefill chunks of this step take together (0: the step budget only).
    engine/engine_loop.py sets it to keep steps beside running decodes within an
    inter-token latency target. A prompt it cuts is cut into the fewest chunks of equal
    size (engine/core/step_cost.py `even_chunk`)."""


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # (request, new tokens to compute), admission order
    block_copies: list[tuple[int, int]]  # copy-on-write (src, dst) to run before the forward
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # stopped by the scheduler itself
    speculating: list[tuple[Request, int]] = field(default_factory=list)
    """Decoding requests given slots for k drafts: (request, k); `with_drafts` fills
    `drafts` from the proposer's proposals and sizes their entries."""
    drafts: dict[str, Proposal] = field(default_factory=dict)
    """Request id -> the drafts it verifies this step (up to its k, those its grammar
    allows; `probs`, where the proposer gave them, are verified by the min(1, p/q) rule).
    Empty until `with_drafts`; `Scheduler.update_from_output` records them."""
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests that left since the previous step (finished, aborted): whatever the runner,
    the sampler or a proposer keeps for them by id is dropped (so are the `preempted`'s)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def with_drafts(self, proposals: list[Proposal]) -> SchedulerOutput:
        """This step with the proposer's drafts for `speculating` (same order): each request
        keeps up to k of them (those its grammar allows) and computes its last token plus
        those. Nothing else changes: slots kept for drafts a request did not get go back to
        the pool when the scheduler applies the step's output."""
        drafts: dict[str, Proposal] = {}
        for (request, k), proposal in zip(self.speculating, proposals):
            ids = proposal.token_ids[:k]
            if request.grammar is not None:  # drafts the grammar forbids are never verified
                del ids[request.grammar.valid_prefix(ids) :]
            drafts[request.request_id] = replace(proposal, token_ids=ids)
        scheduled = [
            (r, 1 + len(drafts[r.request_id].token_ids) if r.request_id in drafts else n)
            for r, n in self.scheduled
        ]
        return replace(self, scheduled=scheduled, drafts=drafts)

    def drafts_of(self, request: Request) -> list[int]:
        """The draft tokens `request` verifies this step (none: it does not)."""
        draft = self.drafts.get(request.request_id)
        return draft.token_ids if draft is not None else []


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
    seconds: float | None = None
    """The runner's wall time for the step (None: not measured, as in hand-built outputs);
    the scheduler's swap policy learns the prefill rate from it."""


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens computed here (not prefix hits or remote KV)
    generation_tokens: int = 0
