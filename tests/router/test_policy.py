"""Placement policies on hand-built candidates (pure: no processes, no clocks)."""

import pytest

from cluster.registration import Capacity
from router.config import PlacementConfig
from router.placement.policy import (
    AffinityPolicy,
    Candidate,
    LeastLoadedPolicy,
    Reason,
    RoundRobinPolicy,
    make_policy,
)

PROMPT = 1024


def dec(wid, running=0, waiting=0, free=1000, total=1000, cached=0, **kw):
    return Candidate(
        wid,
        Capacity(total_blocks=total, free_blocks=free, running=running, waiting=waiting),
        cached_tokens=cached,
        **kw,
    )


def pre(wid, queued=0, rate=1000.0, cached=0, **kw):
    return Candidate(
        wid,
        Capacity(
            total_blocks=1000,
            free_blocks=1000,
            queued_prefill_tokens=queued,
            prefill_tokens_per_s=rate,
        ),
        cached_tokens=cached,
        **kw,
    )


def affinity(**cfg):
    return AffinityPolicy(PlacementConfig(**cfg))


def remote_only(**cfg):
    """Tests of prefill picking: the decode worker never prefills on estimate."""
    return affinity(local_prefill_threshold=0, local_prefill_max_tokens=0, **cfg)


def test_affinity_wins_when_load_is_balanced():
    d = affinity().place(
        PROMPT,
        [dec("a", running=3), dec("b", running=3, cached=768), dec("c", running=3, cached=256)],
        [],
    )
    assert d.decode.worker_id == "b" and d.predicted_cached_tokens == 768


def test_load_wins_when_imbalanced():
    decode = [dec("a", running=1), dec("b", running=30, cached=768)]
    assert affinity().place(PROMPT, decode, []).decode.worker_id == "a"
    # ... and the weights move the balance point: a heavy prefix weight keeps affinity.
    assert affinity(prefix_weight=10.0).place(PROMPT, decode, []).decode.worker_id == "b"


def test_kv_usage_counts_against_a_worker():
    decode = [dec("full", free=50), dec("empty", free=1000)]
    assert affinity().place(PROMPT, decode, []).decode.worker_id == "empty"


def test_router_inflight_counts_as_load_before_capacity_reports_catch_up():
    decode = [dec("a", inflight=20), dec("b")]
    assert affinity().place(PROMPT, decode, []).decode.worker_id == "b"


def test_equal_workers_share_requests():
    policy = affinity()
    picks = {
        policy.place(PROMPT, [dec("a"), dec("b"), dec("c")], []).decode.worker_id for _ in range(6)
    }
    assert picks == {"a", "b", "c"}


def test_prefill_by_estimated_ttft():
    policy = remote_only()
    # p1: 4000 queued at 1000 tok/s -> 5.0 s; p2: 0 queued at 250 tok/s -> 4.1 s; p3 hits 768
    # of the prompt: (3000 + 256) / 1000 = 3.3 s.
    prefill = [pre("p1", queued=4000), pre("p2", rate=250.0), pre("p3", queued=3000, cached=768)]
    d = policy.place(PROMPT, [dec("d")], prefill)
    assert d.reason is Reason.REMOTE and d.prefill.worker_id == "p3"
    assert d.estimated_ttft_s == pytest.approx(3.256)
    assert d.predicted_cached_tokens == 768
    # Unmeasured rate: the configured default applies.
    d = remote_only(default_prefill_rate=100.0).place(PROMPT, [dec("d")], [pre("p", rate=0.0)])
    assert d.estimated_ttft_s == pytest.approx(PROMPT / 100.0)


@pytest.mark.parametrize(
    "cached, threshold, reason",
    [
        (0, 128, Reason.REMOTE),
        (1024 - 128, 128, Reason.REMOTE),  # exactly the threshold uncached: remote
        (1024 - 127, 128, Reason.LOCAL_SHORT),
        (0, 2048, Reason.LOCAL_SHORT),
        (0, 0, Reason.REMOTE),
    ],
)
def test_conditional_disaggregation_threshold(cached, threshold, reason):
    d = affinity(local_prefill_threshold=threshold, local_prefill_max_tokens=0).place(
        PROMPT, [dec("d", cached=cached)], [pre("p")]
    )
    assert d.reason is reason
    assert (d.prefill is None) == (reason is not Reason.REMOTE)


def test_saturated_or_missing_prefill_pool_prefills_locally():
    policy = remote_only(prefill_queue_limit=1000)
    d = policy.place(PROMPT, [dec("d")], [pre("p1", queued=1001), pre("p2", queued=5000)])
    assert d.reason is Reason.LOCAL_SATURATED and d.prefill is None
    d = policy.place(PROMPT, [dec("d")], [pre("p1", queued=1001), pre("p2", queued=1000)])
    assert d.reason is Reason.REMOTE and d.prefill.worker_id == "p2"
    assert policy.place(PROMPT, [dec("d")], []).reason is Reason.LOCAL_NO_PREFILL
    # A prefill worker whose KV layout differs from the decode worker's cannot serve it.
    d = policy.place(PROMPT, [dec("d", compat="x")], [pre("p", compat="y")])
    assert d.reason is Reason.LOCAL_NO_PREFILL


def test_router_inflight_prefill_tokens_count_as_queue():
    policy = affinity(local_prefill_threshold=0)
    d = policy.place(PROMPT, [dec("d")], [pre("p1", inflight_prefill_tokens=8000), pre("p2")])
    assert d.prefill.worker_id == "p2"


@pytest.mark.parametrize("flag", ["draining", "stale"])
def test_draining_and_stale_workers_get_no_work(flag):
    policy = affinity(local_prefill_threshold=0)
    best_decode = dec("d1", cached=1000, **{flag: True})
    best_prefill = pre("p1", cached=1000, **{flag: True})
    for _ in range(4):
        d = policy.place(
            PROMPT, [best_decode, dec("d2", running=50)], [best_prefill, pre("p2", queued=10_000)]
        )
        assert d.decode.worker_id == "d2" and d.prefill.worker_id == "p2"
    assert policy.place(PROMPT, [best_decode], []) is None
    assert policy.place(PROMPT, [dec("d")], [best_prefill]).reason is Reason.LOCAL_NO_PREFILL


def test_no_room_means_no_decision():
    policy = affinity()
    assert policy.place(PROMPT, [], []) is None
    # 1024 + 1 tokens need 65 blocks of 16; a hit of 512 tokens saves 32 of them.
    assert policy.place(PROMPT, [dec("d", free=64)], []) is None
    assert policy.place(PROMPT, [dec("d", free=33, cached=512)], []) is not None
    assert policy.place(PROMPT, [dec("d", waiting=65)], []) is None
    assert policy.place(PROMPT, [dec("d", total=0, free=0)], []) is not None  # size unknown


def test_round_robin_rotates_ignoring_caches_and_load():
    policy = RoundRobinPolicy(
        PlacementConfig(policy="round_robin", local_prefill_threshold=0, local_prefill_max_tokens=0)
    )
    decode = [dec("a", cached=1000), dec("b", running=40), dec("c")]
    prefill = [pre("p", queued=900), pre("q", cached=1000)]
    got = [policy.place(PROMPT, decode, prefill) for _ in range(6)]
    assert [g.decode.worker_id for g in got] == ["b", "c", "a", "b", "c", "a"]
    assert [g.prefill.worker_id for g in got] == ["q", "p", "q", "p", "q", "p"]


def test_least_loaded_picks_fewest_requests_and_shortest_queue():
    policy = LeastLoadedPolicy(
        PlacementConfig(
            policy="least_loaded", local_prefill_threshold=0, local_prefill_max_tokens=0
        )
    )
    d = policy.place(
        PROMPT,
        [dec("a", running=2, cached=1000), dec("b", running=1)],
        [pre("p", queued=10, cached=1000), pre("q", queued=5)],
    )
    assert (d.decode.worker_id, d.prefill.worker_id) == ("b", "q")
    d = policy.place(PROMPT, [dec("a", running=1, free=100), dec("b", running=1, free=900)], [])
    assert d.decode.worker_id == "b"


def test_make_policy_and_config_validation():
    for name, cls in [
        ("affinity", AffinityPolicy),
        ("round_robin", RoundRobinPolicy),
        ("least_loaded", LeastLoadedPolicy),
    ]:
        assert isinstance(make_policy(PlacementConfig(policy=name)), cls)
    with pytest.raises(ValueError, match="policy"):
        PlacementConfig(policy="random")
    with pytest.raises(ValueError, match="load_scale"):
        PlacementConfig(load_scale=0)


def test_short_prompt_goes_local_when_the_prefill_pool_is_busy():
    policy = affinity(local_prefill_threshold=0)
    busy = pre("p", queued=4000, rate=1000.0)  # ~4.3 s before a 300-token prompt is done there
    d = policy.place(300, [dec("d")], [busy])  # 0.3 s locally (assumed as fast as p)
    assert d.reason is Reason.LOCAL_BACKLOG and d.prefill is None
    assert d.estimated_ttft_s == pytest.approx(0.3)
    idle = pre("p", queued=0, rate=1000.0)  # equal estimates: the prefill pool takes it
    assert policy.place(300, [dec("d")], [idle]).reason is Reason.REMOTE
    # The operator's cap overrides the estimate.
    assert (
        affinity(local_prefill_threshold=0, local_prefill_max_tokens=0)
        .place(300, [dec("d")], [busy])
        .reason
        is Reason.REMOTE
    )
    assert (
        affinity(local_prefill_threshold=0, local_prefill_max_tokens=299)
        .place(300, [dec("d")], [busy])
        .reason
        is Reason.REMOTE
    )
