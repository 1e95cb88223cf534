"""What reusing KV costs the worker that computes a prompt, instead of computing it: blocks in
its own pool are free; blocks in its second tier cost their promotion (the worker's measured
seconds per block, `Capacity.kv_promote_s_per_block`); blocks a peer holds beyond its own hit
cost their pull (the worker's measured fixed cost per pull and rate per block,
`Capacity.kv_pull_overhead_s` and `kv_pull_blocks_per_s`) plus the holder's promotion of those
in the holder's tier. Unmeasured, each rate is the configured
default. Pure: candidates and config in, seconds and plans out (router/placement/policy.py decides).

A pull is worth it when it is estimated faster than computing the same tokens at the worker's
measured prefill rate (the rate the TTFT estimates use): no token threshold, the rates decide.
"""

from __future__ import annotations

from typing import Sequence

from router.config import PlacementConfig
from router.placement.candidate import Candidate, PullPlan


def prefill_rate(c: Candidate, config: PlacementConfig) -> float:
    """Prompt tokens per second it computes (measured, else the configured default)."""
    return c.capacity.prefill_tokens_per_s or config.default_prefill_rate


def promote_s(c: Candidate, config: PlacementConfig) -> float:
    """Seconds it takes to promote one block from its second tier."""
    return c.capacity.kv_promote_s_per_block or config.default_kv_promote_s


def can_pull_from(c: Candidate, holder: Candidate) -> bool:
    """`holder` may serve `c` blocks: another usable worker whose KV `c` may join (the P/D
    pairing rule: compat hash and weights version) in blocks of the same size."""
    return (
        holder.worker_id != c.worker_id
        and holder.usable
        and holder.compat == c.compat
        and holder.block_size == c.block_size
    )


def best_pull(c: Candidate, peers: Sequence[Candidate], config: PlacementConfig) -> PullPlan | None:
    """The peer whose blocks beyond `c`'s own hit would save `c` the most time (even a loss,
    so the caller can count a pull it declined: `PullPlan.worth`). None: no usable peer holds
    more of the prompt than `c`, or pulling is off."""
    if not config.kv_pull:
        return None
    bs = c.block_size
    own = c.cached_tokens // bs
    rate = c.capacity.kv_pull_blocks_per_s or config.default_kv_pull_rate
    overhead = c.capacity.kv_pull_overhead_s or config.default_kv_pull_overhead_s
    compute_rate = prefill_rate(c, config)
    best: PullPlan | None = None
    for h in peers:
        extra = h.cached_tokens // bs - own
        if extra <= 0 or not can_pull_from(c, h):
            continue
        # A holder's tier blocks are the tail of its prefix (demotion takes leaves first),
        # so they are counted among the extra blocks first: the costlier estimate.
        tier = min(h.cached_tier_blocks, extra)
        plan = PullPlan(
            h,
            own + extra,
            h.cached_tier_blocks,
            extra * bs,
            overhead + extra / rate + tier * promote_s(h, config),
            extra * bs / compute_rate,
        )
        if best is None or _gain(plan) > _gain(best):
            best = plan
    return best


def _gain(plan: PullPlan) -> tuple[float, int]:
    return plan.recompute_s - plan.seconds, plan.num_blocks


def pulled(c: Candidate) -> PullPlan | None:
    """Its pull plan when pulling was estimated faster than computing, else None."""
    return c.pull if c.pull is not None and c.pull.worth else None


def found_tokens(c: Candidate) -> int:
    """Prompt tokens it will not compute: its own hit (pool and tier) and what it pulls."""
    plan = pulled(c)
    return c.cached_tokens + (plan.extra_tokens if plan is not None else 0)


def promotion_s(c: Candidate, config: PlacementConfig) -> float:
    """Seconds it spends promoting the blocks of its own hit held in its tier."""
    return c.cached_tier_blocks * promote_s(c, config) if c.cached_tier_blocks else 0.0


def reuse_s(c: Candidate, config: PlacementConfig) -> float:
    """Seconds spent getting the KV of `found_tokens`: promoting its tier blocks, pulling."""
    plan = pulled(c)
    return promotion_s(c, config) + (plan.seconds if plan is not None else 0.0)


def effective_cached_tokens(c: Candidate, config: PlacementConfig, own_only: bool = False) -> float:
    """Tokens found, less their reuse time in tokens it could have computed meanwhile: what
    reuse saves it (a pool hit saves its tokens, a tier hit a little less, a pull less
    again). `own_only`: its own cache alone, any pull aside."""
    plan = None if own_only else pulled(c)
    found = c.cached_tokens + (plan.extra_tokens if plan is not None else 0)
    spent = promotion_s(c, config) + (plan.seconds if plan is not None else 0.0)
    return max(0.0, found - spent * prefill_rate(c, config))
