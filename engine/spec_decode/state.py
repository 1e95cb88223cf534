"""A sequence's speculation state and the policy that sizes its drafts.

The policy (vLLM has none; drafts are always k there): each sequence estimates the chance p
that the target accepts its next draft token — an exponential average, per verify step, of
accepted / examined drafts (drafts after the first rejection were never examined) — and
drafts position j only while p**j, the chance that position j is reached and kept, is at
least `MIN_KEEP_CHANCE`. Below `LOW_ACCEPTANCE` it stops drafting for a cool-down that
doubles each time it fails again (up to `MAX_COOLDOWN` steps), then probes with one draft
(p restarts just above the threshold, so one failed probe ends it). A sequence whose drafts
are never accepted thus verifies about log2(steps) failed drafts, and one whose drafts are
accepted reaches the full k after one step."""

from __future__ import annotations

from dataclasses import dataclass

LOW_ACCEPTANCE = 0.2  # p below this: stop drafting for a while
MIN_KEEP_CHANCE = 0.15  # draft position j only while p**j >= this
INITIAL = 0.5  # p of a new sequence: 2 drafts first
PROBE = 0.3  # p after a cool-down: 1 draft; a failure ends the probe
MAX_COOLDOWN = 256  # steps
_EMA = 0.5  # weight of the newest verify step


@dataclass(slots=True)
class SpecState:
    max_k: int  # num_speculative_tokens
    adaptive: bool = True
    num_draft_computed: int = 0
    """A separate draft model only: positions whose draft-model KV is in the draft pool
    (the drafter catches up from here; its Proposal says how far it got). Reset on
    preemption, cut back on rejection."""
    acceptance: float = INITIAL  # p: estimated chance the next draft token is accepted
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
        k, reach = 0, self.acceptance
        while k < self.max_k and reach >= MIN_KEEP_CHANCE:
            k, reach = k + 1, reach * self.acceptance
        return max(1, k)

    def record(self, proposed: int, accepted: int) -> None:
        """One verify step's outcome (proposed >= 1)."""
        examined = accepted + (accepted < proposed)
        self.acceptance = (1 - _EMA) * self.acceptance + _EMA * accepted / examined
        if self.acceptance < LOW_ACCEPTANCE:
            self.cooldown, self.backoff = self.backoff, min(2 * self.backoff, MAX_COOLDOWN)
            self.acceptance = PROBE
        elif accepted == proposed:
            self.backoff = 1
