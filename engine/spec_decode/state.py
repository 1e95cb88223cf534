"""A sequence's speculation state and the policy that sizes its drafts.

The policy (vLLM has none; drafts are always k there): a sequence whose drafts are mostly
rejected stops paying for verification. Its acceptance rate is an exponential average over
its verify steps; below `LOW_ACCEPTANCE` it stops drafting for a cool-down that doubles
each time it fails again (up to `MAX_COOLDOWN` steps), then probes with a full k again.
Between, the draft length follows the acceptance rate, so a sequence that accepts half its
drafts is not asked to verify k of them."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LOW_ACCEPTANCE = 0.2  # below: stop drafting for a while
FULL_ACCEPTANCE = 0.6  # at or above: draft the full k
MAX_COOLDOWN = 32  # steps
_EMA = 0.5  # weight of the newest verify step


@dataclass(slots=True)
class SpecState:
    max_k: int  # num_speculative_tokens
    adaptive: bool = True
    drafts: list[int] = field(default_factory=list)
    """Draft tokens being verified in the current step (after the request's tokens); set
    between schedule and execute, cleared when the step's output is applied."""
    draft_probs: torch.Tensor | None = None
    """The drafts' distributions ([len(drafts), vocab]) when the proposer gave them."""
    num_draft_computed: int = 0
    """A separate draft model only: positions whose draft-model KV is in the draft pool
    (the drafter catches up from here). Reset on preemption, cut back on rejection."""
    acceptance: float = 1.0
    cooldown: int = 0  # steps left without drafting
    backoff: int = 1  # the next cool-down's length

    def fresh(self) -> "SpecState":
        """The same settings, no history (a forked completion)."""
        return SpecState(self.max_k, self.adaptive)

    def allowance(self) -> int:
        """Drafts this sequence may verify in the step being scheduled (called once per
        step it is scheduled in: a cool-down counts those steps down)."""
        if not self.adaptive:
            return self.max_k
        if self.cooldown:
            self.cooldown -= 1
            return 0
        share = min(1.0, self.acceptance / FULL_ACCEPTANCE)
        return max(1, math.ceil(self.max_k * share))

    def record(self, proposed: int, accepted: int) -> None:
        """One verify step's outcome (proposed >= 1)."""
        self.acceptance = (1 - _EMA) * self.acceptance + _EMA * accepted / proposed
        if self.acceptance < LOW_ACCEPTANCE:
            self.cooldown, self.backoff = self.backoff, min(2 * self.backoff, MAX_COOLDOWN)
            self.acceptance = FULL_ACCEPTANCE  # the probe after the cool-down drafts k
        elif self.acceptance >= FULL_ACCEPTANCE:
            self.backoff = 1
