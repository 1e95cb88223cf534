"""One worker as placement sees it for one request (`Candidate`), and the blocks it could pull
from a peer instead of computing them (`PullPlan`). Plain values: router/placement/placer.py builds
them, router/placement/policy.py and router/placement/reuse.py read them."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.registration import Capacity


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker as placement sees it for one request."""

    worker_id: str
    capacity: Capacity
    block_size: int = 16
    cached_tokens: int = 0
    """Longest prefix of this request's prompt in the worker's cache (from the KV index),
    pool and second tier."""
    cached_tier_blocks: int = 0
    """Of the blocks of `cached_tokens`, those in its second KV tier (promoted before use)."""
    inflight: int = 0
    """Requests this router has running on it (covers capacity reports that lag)."""
    inflight_prefill_tokens: int = 0
    """Prompt tokens this router sent it that have not produced their first token yet."""
    compat: str = ""
    """KV compatibility hash: a prefill worker serves only decode workers with the same one."""
    draining: bool = False
    stale: bool = False
    """Registration not republished recently: capacity unknown, no new work."""
    lora_missing: bool = False
    """The request's LoRA adapter is not loaded there (it would load it from disk first)."""
    pull: PullPlan | None = None
    """Where it would pull more of the prompt from if it computed it: set by the policy when
    a peer holds more (kv_reuse.best_pull; used only when `pull.worth`)."""

    @property
    def usable(self) -> bool:
        return not (self.draining or self.stale)

    @property
    def load(self) -> int:
        return max(self.capacity.running + self.capacity.waiting, self.inflight)

    @property
    def kv_usage(self) -> float:
        total = self.capacity.total_blocks
        return 1.0 - self.capacity.free_blocks / total if total > 0 else 0.0

    @property
    def queued_prefill_tokens(self) -> int:
        return max(self.capacity.queued_prefill_tokens, self.inflight_prefill_tokens)


@dataclass(frozen=True, slots=True)
class PullPlan:
    """The best peer to pull a prompt's blocks from, for one computing worker."""

    holder: Candidate
    num_blocks: int
    """The holder's leading blocks of the prompt (counted from block 0; the puller skips
    what it holds itself)."""
    num_tier_blocks: int
    """How many of those sit in the holder's second tier."""
    extra_tokens: int
    """Prompt tokens the pull covers beyond the puller's own hit."""
    seconds: float
    """Estimated pull time: the extra blocks at the puller's pull rate + the holder's
    promotion of those of them in its tier."""
    recompute_s: float
    """Estimated time to compute the same tokens at the puller's prefill rate."""

    @property
    def worth(self) -> bool:
        return self.seconds < self.recompute_s
