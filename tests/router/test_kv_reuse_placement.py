"""Placement with KV tiers and peer pulls (router/placement/reuse.py, router/placement/policy.py,
router/placement/placer.py): a tier hit is credited at its measured promotion cost, and the worker
that computes a prompt pulls the blocks a peer holds beyond its own hit when the measured
rates say that beats computing them."""

import dataclasses

import pytest

from cluster.registration import Capacity, WorkerInfo
from router.config import PlacementConfig
from router.metrics import RouterMetrics
from router.placement.index import KVIndex
from router.placement.placer import KVSource, Placer, PromptKey
from router.placement.policy import AffinityPolicy, Candidate, Reason
from router.placement.reuse import best_pull

PROMPT = 1024  # 64 blocks of 16; the last is never reused (its last token is computed): 63
HELD = 63 * 16
OVERHEAD = 0.01  # --default-kv-pull-overhead: a pull's fixed cost until the worker measured it


def cand(wid, cached=0, tier=0, rate=2000.0, queued=0, free=1000, **cap):
    capacity = Capacity(
        total_blocks=1000,
        free_blocks=free,
        prefill_tokens_per_s=rate,
        queued_prefill_tokens=queued,
        **cap,
    )
    return Candidate(wid, capacity, cached_tokens=cached, cached_tier_blocks=tier, compat="c")


def policy(**cfg):
    return AffinityPolicy(PlacementConfig(**cfg))


def test_a_tier_hit_is_credited_at_its_promotion_cost():
    slow = dict(kv_promote_s_per_block=0.01)  # 63 blocks: 0.63 s, at 2000 tokens/s 1260 tokens
    pol = policy()
    pool, tier = cand("pool", HELD), cand("tier", HELD, tier=63, **slow)
    assert pol.decode_score(PROMPT, pool) > pol.decode_score(PROMPT, tier)
    assert pol.place(PROMPT, [tier, pool], []).decode.worker_id == "pool"
    # Promotion as cheap as the default (0.1 ms): a tier hit is nearly a pool hit, less the
    # tokens computed meanwhile (63 x 0.0001 s x 2000 tokens/s).
    assert pol.decode_score(PROMPT, pool) - pol.decode_score(
        PROMPT, cand("t", HELD, tier=63)
    ) == pytest.approx(63 * 0.0001 * 2000 / PROMPT)
    # A prefill worker's TTFT: its tier blocks add their promotion time.
    assert pol.estimated_ttft_s(PROMPT, tier) - pol.estimated_ttft_s(PROMPT, pool) == pytest.approx(
        63 * 0.01
    )
    # Unmeasured: the configured default per block.
    untimed = cand("u", HELD, tier=10)
    assert policy(default_kv_promote_s=0.5).estimated_ttft_s(
        PROMPT, untimed
    ) - pol.estimated_ttft_s(PROMPT, pool) == pytest.approx(5.0)


def test_promoted_blocks_need_free_pool_blocks():
    pol = policy()
    assert pol.has_room(cand("d", HELD, free=2), PROMPT)  # 65 blocks: 63 held in the pool
    assert not pol.has_room(cand("d", HELD, tier=63, free=2), PROMPT)


def test_a_prefix_the_decode_worker_can_pull_makes_the_prompt_short_to_prefill_locally():
    d, holder = cand("d"), cand("p", HELD)
    without = policy().place(PROMPT, [d], [holder])
    assert without.reason is Reason.REMOTE and without.kv_pull is None
    decision = policy().place(PROMPT, [d], [holder], peers=[holder])
    assert decision.reason is Reason.LOCAL_SHORT and decision.prefill is None
    plan = decision.kv_pull
    assert plan.holder.worker_id == "p" and plan.num_blocks == 63 and plan.num_tier_blocks == 0
    assert plan.extra_tokens == HELD and plan.seconds == pytest.approx(OVERHEAD + 63 / 2000)
    assert decision.predicted_cached_tokens == 0  # tokens found in its own cache


def test_the_measured_rates_decide_between_pulling_and_computing():
    holder = cand("h", HELD)
    # Pulls measured slow (10 blocks/s: 6.3 s) against computing at 2000 tokens/s (0.5 s).
    slow_puller = cand("d", kv_pull_blocks_per_s=10.0)
    decision = policy().place(PROMPT, [slow_puller], [], peers=[holder])
    assert decision.kv_pull is None and decision.kv_pull_declined
    # A slow prefill rate makes the same pull worth it (10 tokens/s: 100 s to compute).
    slow_compute = cand("d", kv_pull_blocks_per_s=10.0, rate=10.0)
    assert policy().place(PROMPT, [slow_compute], [], peers=[holder]).kv_pull is not None
    # The holder's promotions count: all its blocks in a slow tier tip it to computing.
    tiered = cand("h", HELD, tier=63, kv_promote_s_per_block=0.05)
    decision = policy().place(PROMPT, [cand("d")], [], peers=[tiered])
    assert decision.kv_pull is None and decision.kv_pull_declined
    fast_tier = cand("h", HELD, tier=63, kv_promote_s_per_block=0.0001)
    plan = policy().place(PROMPT, [cand("d")], [], peers=[fast_tier]).kv_pull
    assert plan.num_tier_blocks == 63 and plan.seconds == pytest.approx(
        OVERHEAD + 63 / 2000 + 63 * 0.0001
    )


def test_only_what_the_puller_lacks_is_priced_and_the_best_holder_wins():
    d = cand("d", 32 * 16)
    far, near = cand("far", HELD, kv_pull_blocks_per_s=1.0), cand("near", 40 * 16)
    plan = policy().place(PROMPT, [d], [], peers=[near, far, d]).kv_pull
    assert plan.holder.worker_id == "far" and plan.num_blocks == 63
    assert plan.extra_tokens == 31 * 16 and plan.seconds == pytest.approx(OVERHEAD + 31 / 2000)
    assert policy().place(PROMPT, [cand("d", HELD)], [], peers=[far]).kv_pull is None


@pytest.mark.parametrize(
    "change",
    [
        dict(compat="other"),
        dict(draining=True),
        dict(stale=True),
        dict(block_size=32),
    ],
)
def test_no_pull_from_a_worker_whose_kv_cannot_be_joined(change):
    holder = dataclasses.replace(cand("h", HELD), **change)
    decision = policy().place(PROMPT, [cand("d")], [], peers=[holder])
    assert decision.kv_pull is None and not decision.kv_pull_declined


def test_kv_pull_off():
    decision = policy(kv_pull=False).place(PROMPT, [cand("d")], [], peers=[cand("h", HELD)])
    assert decision.kv_pull is None and not decision.kv_pull_declined


def test_the_prefill_worker_pulls_what_the_decode_worker_holds():
    d, p = cand("d", 40 * 16), cand("p", rate=1000.0)
    decision = policy(local_prefill_threshold=0, local_prefill_max_tokens=0).place(
        PROMPT, [d], [p], peers=[d]
    )
    assert decision.reason is Reason.REMOTE and decision.compute.worker_id == "p"
    assert decision.kv_pull.holder.worker_id == "d" and decision.kv_pull.num_blocks == 40
    # ... and its TTFT estimate computes only the rest, after the pull.
    assert decision.estimated_ttft_s == pytest.approx((PROMPT - 640) / 1000 + OVERHEAD + 40 / 2000)


def info(wid, role, **cap):
    return WorkerInfo(
        wid,
        role,
        f"{wid}:1",
        "m",
        "c",
        16,
        capacity=Capacity(total_blocks=1000, free_blocks=1000, prefill_tokens_per_s=2000.0, **cap),
    )


def test_placer_names_the_holder_and_counts_the_decision():
    from router.placement.registry import WorkerRegistry

    registry, index, metrics = WorkerRegistry(), KVIndex(), RouterMetrics()
    for wid, role in (("d", "decode"), ("p", "prefill")):
        registry.put(info(wid, role))
    key = PromptKey(list(range(PROMPT)))
    index.stored("p", key.hashes(16), [0] * 60 + [1] * 3)  # its last 3 blocks in its tier
    placer = Placer(registry, index, AffinityPolicy(PlacementConfig()), metrics)
    placement = placer.place(key)
    assert placement.decision.reason is Reason.LOCAL_SHORT and placement.prefill is None
    assert placement.kv_source == KVSource(registry.get("p"), 63, 3)

    def count(outcome):
        return metrics.registry.get_sample_value(
            "pdserve_router_kv_pull_decisions_total", {"outcome": outcome}
        )

    assert (count("pull"), count("recompute")) == (1, 0)
    # Excluded workers (they failed this request) are no holders.
    assert placer.place(key, exclude=frozenset({"p"})).kv_source is None
    # A decode worker whose pulls are measured slow computes instead: when it must prefill
    # (n > 1 ...), counted; otherwise the prefill worker computes, with its own cache.
    registry.put(dataclasses.replace(info("d", "decode", kv_pull_blocks_per_s=1.0), updated_at=1))
    placement = placer.place(key, remote_prefill=False)
    assert placement.kv_source is None and placement.prefill is None
    assert (count("pull"), count("recompute")) == (1, 1)
    placement = placer.place(key)
    assert placement.kv_source is None and placement.prefill.info.worker_id == "p"
    assert (count("pull"), count("recompute")) == (1, 1)


def test_a_measured_fixed_cost_per_pull_decides_small_pulls():
    """Two blocks at 20000 blocks/s are 0.1 ms of copy, but a pull's measured fixed cost of
    0.1 s is more than computing those 32 tokens (16 ms at 2000 tokens/s): not pulled."""
    measured = dict(kv_pull_overhead_s=0.1, kv_pull_blocks_per_s=20000.0)
    puller = cand("d", 61 * 16, **measured)
    plan = best_pull(puller, [cand("h", HELD)], PlacementConfig())
    assert plan.seconds == pytest.approx(0.1 + 2 / 20000) and not plan.worth
    far = cand("d", 0, **measured)  # all 63 blocks: 0.103 s against 0.5 s of computing
    assert best_pull(far, [cand("h", HELD)], PlacementConfig()).worth
