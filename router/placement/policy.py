"""Placement: which decode worker runs a request, and which prefill worker (if any) computes
its prompt. Pure: no I/O, no clocks — callers pass snapshots (`Candidate`s) and get a
`Decision`; a policy's only state is its rotation counter (tie-breaks and round-robin) and
its learned TTFT correction (fed by the caller with observed TTFTs).

Contract shared by every policy:
- Draining or stale candidates never receive work.
- A decode candidate needs room: waiting <= max_waiting_per_worker and enough free KV blocks
  for the prompt's uncached blocks plus one (when its pool size is known). None has room ->
  `place` returns None (the caller queues, then answers 503).
- Conditional disaggregation: the chosen decode worker prefills locally when its uncached part
  of the prompt is below `local_prefill_threshold`, when no prefill worker is usable (usable:
  not draining, not stale, same KV compatibility hash), when every usable prefill worker
  has more than `prefill_queue_limit` tokens queued, or when its own estimated TTFT beats the
  best prefill worker's (router/placement/estimates.py: live queues and measured step costs, each
  path corrected by what it was observed to miss) by more than the stall its chunks put on
  each decode running there (the prompt's compute time), without pushing their
  inter-token latency over `itl_slo_ms` — for any prompt length, unless the operator capped
  it with `local_prefill_max_tokens`.
- KV reuse (router/placement/reuse.py): a worker's own hit counts at its cost — pool blocks free,
  second-tier blocks their measured promotion time. Given `peers` (every worker that may
  hold this prompt's blocks), the worker that computes the prompt pulls the blocks a usable
  peer of its KV layout holds beyond its own hit when that is estimated faster than computing
  them (`Decision.kv_pull`); what it pulls is not computed, in the TTFT estimates and the
  local-vs-remote choice alike. The decode choice weighs a worker's own cache only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from cluster.roles import PrefillPath
from router.config import PlacementConfig
from router.placement.candidate import Candidate, PullPlan
from router.placement.estimates import (
    LocalEstimate,
    TTFTCorrection,
    local_prefill,
    queue_ttft_s,
    step_cost,
)
from router.placement.reuse import (
    best_pull,
    effective_cached_tokens,
    found_tokens,
    prefill_rate,
    pulled,
    reuse_s,
)


class Reason(str, enum.Enum):
    """Why a decision came out the way it did (a /metrics label)."""

    REMOTE = "remote"  # a prefill worker computes the prompt
    LOCAL_SHORT = "local_short"  # uncached part below the threshold
    LOCAL_SATURATED = "local_saturated"  # every prefill worker's queue is over the limit
    LOCAL_FASTER = "local_faster"  # the decode worker answers sooner than even an idle pool
    LOCAL_BACKLOG = "local_backlog"  # it answers sooner because the prefill pool is backed up
    LOCAL_NO_PREFILL = "local_no_prefill"  # no usable prefill worker
    NO_CAPACITY = "no_capacity"  # no decode worker has room (place returned None)


@dataclass(frozen=True, slots=True)
class Decision:
    decode: Candidate
    prefill: Candidate | None  # None: the decode worker prefills locally
    reason: Reason
    predicted_cached_tokens: int
    """Prompt tokens expected to be found cached (the better of the two workers used)."""
    estimated_ttft_s: float | None = None
    """The chosen path's TTFT estimate, before correction (None: no estimate was needed)."""

    @property
    def path(self) -> PrefillPath:
        """The planned path (one of `ttft_estimate.PLANNED_PATHS`)."""
        return PrefillPath.LOCAL if self.prefill is None else PrefillPath.REMOTE

    @property
    def compute(self) -> Candidate:
        """The worker that computes the prompt: the prefill worker, else the decode worker."""
        return self.decode if self.prefill is None else self.prefill

    @property
    def kv_pull(self) -> PullPlan | None:
        """Blocks the computing worker pulls from a peer first (None: it pulls nothing)."""
        return pulled(self.compute)

    @property
    def kv_pull_declined(self) -> bool:
        """A peer held more of the prompt, but computing it was estimated faster."""
        plan = self.compute.pull
        return plan is not None and not plan.worth


class Policy:
    """Base: filtering and conditional disaggregation; subclasses pick among candidates."""

    name = "base"

    def __init__(self, config: PlacementConfig) -> None:
        self.config = config
        self._turn = 0
        self.correction = TTFTCorrection()
        """Learned per path; the dispatcher feeds it each request's observed TTFT."""

    def place(
        self,
        num_prompt_tokens: int,
        decode: Sequence[Candidate],
        prefill: Sequence[Candidate],
        peers: Sequence[Candidate] = (),
    ) -> Decision | None:
        """`peers`: workers (any role) whose blocks of the prompt the computing worker may
        pull (none: no pulls)."""
        self._turn += 1
        rooms = [c for c in decode if self.has_room(c, num_prompt_tokens)]
        if not rooms:
            return None
        d = self.with_pull(self.pick_decode(num_prompt_tokens, rooms), peers)
        uncached = num_prompt_tokens - effective_cached_tokens(d, self.config)
        if uncached < self.config.local_prefill_threshold:
            return Decision(d, None, Reason.LOCAL_SHORT, d.cached_tokens)
        usable = [c for c in prefill if c.usable and c.compat == d.compat]
        if not usable:
            return Decision(d, None, Reason.LOCAL_NO_PREFILL, d.cached_tokens)
        open_ = [
            self.with_pull(c, peers)
            for c in usable
            if c.queued_prefill_tokens <= self.config.prefill_queue_limit
        ]
        if not open_:
            return Decision(d, None, Reason.LOCAL_SATURATED, d.cached_tokens)
        p = self.pick_prefill(num_prompt_tokens, open_)
        remote_s = self.estimated_ttft_s(num_prompt_tokens, p)
        remote = Decision(d, p, Reason.REMOTE, max(d.cached_tokens, p.cached_tokens), remote_s)
        cap = self.config.local_prefill_max_tokens
        if cap is not None and uncached > cap:
            return remote
        local = self.local_estimate(num_prompt_tokens, d, p)
        if local is None or not self.keeps_itl(d, local):
            return remote
        fix = self.correction.corrected
        # Local pays twice: this prompt's wait, and the stall its chunks put on each decode
        # sharing their steps (remote costs the decodes nothing): only a clear win goes local.
        local_cost_s = fix(PrefillPath.LOCAL, local.ttft_s) + local.decode_delay_s
        if local_cost_s >= fix(PrefillPath.REMOTE, remote_s):
            return remote
        # Would the prefill pool have won with an empty queue? Then its backlog is why not.
        idle_s = fix(PrefillPath.REMOTE, self.estimated_ttft_s(num_prompt_tokens, p, queued=0))
        reason = Reason.LOCAL_BACKLOG if idle_s <= local_cost_s else Reason.LOCAL_FASTER
        return Decision(d, None, reason, d.cached_tokens, local.ttft_s)

    def with_pull(self, c: Candidate, peers: Sequence[Candidate]) -> Candidate:
        """`c` with the best plan to pull more of the prompt from one of `peers`, if any."""
        plan = best_pull(c, peers, self.config) if peers else None
        return c if plan is None else replace(c, pull=plan)

    def local_estimate(
        self, num_prompt_tokens: int, d: Candidate, p: Candidate
    ) -> LocalEstimate | None:
        """`d` prefilling the prompt itself, beside its running decodes (the more of its
        published running count and this router's requests on it); `p`'s measured rate
        stands in for d's speed until d has measured its own. Its reused KV (promoted, pulled)
        and a LoRA adapter to load come first."""
        cost = step_cost(
            d.capacity, p.capacity.prefill_tokens_per_s, self.config.default_prefill_rate
        )
        decoding = max(d.capacity.running, d.inflight)
        est = local_prefill(
            d.capacity, d.queued_prefill_tokens, num_prompt_tokens - found_tokens(d), decoding, cost
        )
        before_s = reuse_s(d, self.config) + (self.config.lora_load_s if d.lora_missing else 0.0)
        if est is None or not before_s:
            return est
        return LocalEstimate(est.ttft_s + before_s, est.step_s, est.decode_delay_s)

    def keeps_itl(self, d: Candidate, local: LocalEstimate) -> bool:
        """Its running decodes keep their inter-token latency within the SLO while the
        prompt's chunks run beside them (nothing running: nothing to protect)."""
        slo_s = self.config.itl_slo_ms / 1000
        return not slo_s or max(d.capacity.running, d.inflight) == 0 or local.step_s <= slo_s

    def place_prefill(
        self, num_prompt_tokens: int, prefill: Sequence[Candidate]
    ) -> Candidate | None:
        """Prompt-only work (embeddings), which no decode worker takes: `pick_prefill` among
        the usable prefill candidates, over the queue limit too (there is no local
        fallback). None: none usable."""
        self._turn += 1
        usable = [c for c in prefill if c.usable]
        return self.pick_prefill(num_prompt_tokens, usable) if usable else None

    def has_room(self, c: Candidate, num_prompt_tokens: int) -> bool:
        if not c.usable or c.capacity.waiting > self.config.max_waiting_per_worker:
            return False
        if c.capacity.total_blocks <= 0:  # pool size not reported: assume room
            return True
        bs = c.block_size
        # Only pool hits are blocks it holds; promoted (and pulled) blocks take free ones.
        needed = -(-(num_prompt_tokens + 1) // bs) - (c.cached_tokens // bs - c.cached_tier_blocks)
        return c.capacity.free_blocks >= needed

    def estimated_ttft_s(
        self, num_prompt_tokens: int, p: Candidate, queued: int | None = None
    ) -> float:
        """A prefill worker's: (queued prefill tokens + this request's tokens it neither
        holds nor pulls) / its measured prefill rate (the configured default until measured),
        plus its reuse time (promotions, the pull) and the time to load the request's LoRA
        adapter where it is missing. `queued`: instead of its queue."""
        cfg = self.config
        load_lora = cfg.lora_load_s if p.lora_missing else 0.0
        queued = p.queued_prefill_tokens if queued is None else queued
        return queue_ttft_s(
            queued,
            num_prompt_tokens - found_tokens(p),
            prefill_rate(p, cfg),
            reuse_s(p, cfg) + load_lora,
        )

    def pick_decode(self, num_prompt_tokens: int, cands: Sequence[Candidate]) -> Candidate:
        raise NotImplementedError

    def pick_prefill(self, num_prompt_tokens: int, cands: Sequence[Candidate]) -> Candidate:
        raise NotImplementedError

    def _best(self, cands: Sequence[Candidate], key: Callable[[Candidate], object]) -> Candidate:
        """Lowest key; ties go to the next candidate in rotation (equal workers share work)."""
        start = self._turn % len(cands)
        best, best_key = None, None
        for i in range(len(cands)):
            c = cands[(start + i) % len(cands)]
            k = key(c)
            if best is None or k < best_key:  # type: ignore[operator]
                best, best_key = c, k
        assert best is not None
        return best


class AffinityPolicy(Policy):
    """Decode: prefix overlap vs load vs KV usage vs the request's LoRA adapter not loaded
    there (weighted). Prefill: lowest estimated TTFT (an adapter to load adds its time)."""

    name = "affinity"

    def decode_score(self, num_prompt_tokens: int, c: Candidate) -> float:
        cfg = self.config
        saved = effective_cached_tokens(c, cfg, own_only=True)
        hit = saved / num_prompt_tokens if num_prompt_tokens else 0.0
        return (
            cfg.prefix_weight * hit
            - cfg.load_weight * c.load / cfg.load_scale
            - cfg.kv_weight * c.kv_usage
            - cfg.lora_weight * c.lora_missing
        )

    def pick_decode(self, num_prompt_tokens: int, cands: Sequence[Candidate]) -> Candidate:
        return self._best(cands, lambda c: -self.decode_score(num_prompt_tokens, c))

    def pick_prefill(self, num_prompt_tokens: int, cands: Sequence[Candidate]) -> Candidate:
        return self._best(cands, lambda c: self.estimated_ttft_s(num_prompt_tokens, c))


class RoundRobinPolicy(Policy):
    """Each pool in turn, ignoring load and caches (a baseline)."""

    name = "round_robin"

    def pick_decode(self, num_prompt_tokens: int, cands: Sequence[Candidate]) -> Candidate:
        return sorted(cands, key=lambda c: c.worker_id)[self._turn % len(cands)]

    def pick_prefill(self, num_prompt_tokens: int, cands: Sequence[Candidate]) -> Candidate:
        return sorted(cands, key=lambda c: c.worker_id)[self._turn % len(cands)]


class LeastLoadedPolicy(Policy):
    """Decode: fewest requests, then least KV in use. Prefill: fewest queued tokens."""

    name = "least_loaded"

    def pick_decode(self, num_prompt_tokens: int, cands: Sequence[Candidate]) -> Candidate:
        return self._best(cands, lambda c: (c.load, c.kv_usage))

    def pick_prefill(self, num_prompt_tokens: int, cands: Sequence[Candidate]) -> Candidate:
        return self._best(cands, lambda c: c.queued_prefill_tokens)


_POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (AffinityPolicy, RoundRobinPolicy, LeastLoadedPolicy)
}


def make_policy(config: PlacementConfig) -> Policy:
    return _POLICIES[config.policy](config)
