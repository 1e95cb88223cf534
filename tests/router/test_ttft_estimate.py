"""Load-aware conditional disaggregation on hand-built snapshots (pure: no processes, no
clocks): the TTFT estimates of both paths (router/placement/estimates.py) and the decisions the
policy takes from them."""

from dataclasses import replace

import pytest

from cluster.registration import Capacity
from cluster.roles import PrefillPath
from router.config import PlacementConfig
from router.placement.estimates import (
    LocalEstimate,
    StepCost,
    TTFTCorrection,
    local_prefill,
    step_cost,
)
from router.placement.policy import AffinityPolicy, Candidate, Reason

LONG = 2048


def decode_worker(running=8, overhead_s=0.036, per_token_s=0.0005, chunk=256, budget=2048, **kw):
    """A decode worker that measured both kinds of step: decode steps of `running` rows, and
    steps with a `chunk`-token prompt chunk beside them, both on the line
    overhead_s + per_token_s * tokens (its own published timings; nothing assumed)."""
    cap = Capacity(
        total_blocks=10_000,
        free_blocks=10_000,
        running=running,
        decode_step_s=overhead_s + per_token_s * running,
        decode_step_tokens=running,
        prefill_step_s=overhead_s + per_token_s * (running + chunk),
        prefill_step_tokens=running + chunk,
        prefill_tokens_per_s=chunk / (overhead_s + per_token_s * (running + chunk)),
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=chunk,
    )
    return Candidate("d", cap, **kw)


def prefill_worker(queued=0, rate=2000.0, wid="p", **kw):
    return Candidate(
        wid,
        Capacity(
            total_blocks=10_000,
            free_blocks=10_000,
            queued_prefill_tokens=queued,
            prefill_tokens_per_s=rate,
        ),
        **kw,
    )


def policy(**cfg):
    cfg.setdefault("local_prefill_threshold", 0)
    return AffinityPolicy(PlacementConfig(**cfg))


# ---- the decisions --------------------------------------------------------------------


def test_backed_up_prefill_pool_sends_a_long_prompt_to_the_decode_worker():
    # Locally: 8 chunks of 256 beside 8 decodes, 0.168 s each -> 1.344 s; each step stays
    # under the 250 ms ITL SLO. The pool: (6000 queued + 2048) / 2000 tok/s = 4.0 s.
    d = policy().place(LONG, [decode_worker()], [prefill_worker(queued=6000)])
    assert d.reason is Reason.LOCAL_BACKLOG and d.prefill is None
    assert d.estimated_ttft_s == pytest.approx(8 * (0.036 + 0.0005 * 264))
    assert d.path is PrefillPath.LOCAL


def test_idle_prefill_pool_keeps_it_remote():
    # The pool: 2048 / 2000 = 1.02 s, sooner than 1.34 s locally.
    d = policy().place(LONG, [decode_worker()], [prefill_worker()])
    assert d.reason is Reason.REMOTE and d.prefill.worker_id == "p"
    assert d.estimated_ttft_s == pytest.approx(LONG / 2000)
    assert d.path is PrefillPath.REMOTE


def test_a_decode_worker_near_the_itl_slo_keeps_it_remote():
    backed_up = [prefill_worker(queued=6000)]
    # 64 decodes at 0.2 s a step: a 256-token chunk beside them makes it 0.33 s > 250 ms.
    busy = decode_worker(running=64, overhead_s=0.168)
    assert policy().place(LONG, [busy], backed_up).reason is Reason.REMOTE
    # ... a looser SLO, or none, lets it prefill (it still answers sooner).
    assert policy(itl_slo_ms=400).place(LONG, [busy], backed_up).reason is Reason.LOCAL_BACKLOG
    assert policy(itl_slo_ms=0).place(LONG, [busy], backed_up).reason is Reason.LOCAL_BACKLOG
    # This router's own requests on it count as decodes before its report catches up.
    assert (
        policy()
        .place(LONG, [decode_worker(running=0, inflight=64, overhead_s=0.168)], backed_up)
        .reason
        is Reason.REMOTE
    )
    # Without a long-prefill threshold the chunk is the whole budget left: a 2040-token step
    # (1.06 s) would stall the decodes.
    uncapped = Candidate("d", replace(decode_worker().capacity, long_prefill_token_threshold=0))
    assert policy().place(LONG, [uncapped], backed_up).reason is Reason.REMOTE
    # With nothing decoding there is nothing to protect.
    idle = Candidate("d", replace(uncapped.capacity, running=0))
    assert policy().place(LONG, [idle], backed_up).reason is Reason.LOCAL_BACKLOG


def test_measured_rates_change_the_decision():
    pool = [prefill_worker(queued=4000)]  # (4000 + 2048) / 2000 = 3.02 s
    # Local: its TTFT + the stall on each running decode (the prompt's compute time).
    fast = decode_worker(per_token_s=0.0005)  # 1.34 s + 1.02 s = 2.37 s
    slow = decode_worker(per_token_s=0.001, overhead_s=0.002)  # 8 * 0.266 + 2.05 = 4.18 s
    assert policy(itl_slo_ms=0).place(LONG, [fast], pool).reason is Reason.LOCAL_BACKLOG
    assert policy(itl_slo_ms=0).place(LONG, [slow], pool).reason is Reason.REMOTE
    # The prefill worker's measured rate moves it too: at 4000 tok/s the pool answers in
    # 1.51 s even with its queue.
    assert (
        policy().place(LONG, [fast], [prefill_worker(queued=4000, rate=4000.0)]).reason
        is Reason.REMOTE
    )


def test_a_small_gain_does_not_pay_for_stalling_the_decodes():
    pool = [prefill_worker(queued=1000)]  # (1000 + 2048) / 2000 = 1.52 s
    # Sooner locally (1.34 s), but its chunks hold up 8 running decodes by 1.02 s each.
    d = policy().place(LONG, [decode_worker()], pool)
    assert d.reason is Reason.REMOTE
    assert policy().local_estimate(LONG, decode_worker(), pool[0]).decode_delay_s == pytest.approx(
        LONG * 0.0005
    )
    # Nothing decoding there: nothing stalls, the sooner path wins.
    idle = Candidate("d", replace(decode_worker().capacity, running=0))
    assert policy().place(LONG, [idle], pool).prefill is None


def test_local_faster_when_the_decode_worker_beats_even_an_idle_pool():
    # An idle decode worker (nothing to stall) against an idle pool whose answers come 1 s
    # after its estimate (the hand-off, learned): local wins without any queue.
    p = policy()
    for _ in range(50):
        p.correction.observe(PrefillPath.REMOTE, estimated_s=1.0, observed_s=2.0)
    idle = Candidate("d", replace(decode_worker().capacity, running=0))
    assert p.place(LONG, [idle], [prefill_worker()]).reason is Reason.LOCAL_FASTER


def test_a_decode_worker_is_never_assumed_faster_per_token_than_the_pool_measured():
    # Its line through memory-bound decode steps says 0.5 ms a token; a slow pool measured
    # 2 ms a token on whole prompts (500 tok/s): the local estimate uses the pool's figure.
    d = decode_worker()
    est = policy().local_estimate(LONG, d, prefill_worker(rate=500.0))
    assert est.decode_delay_s == pytest.approx(LONG * 0.002)
    assert policy().place(LONG, [d], [prefill_worker(rate=500.0)]).reason is Reason.REMOTE


def test_its_own_queue_counts_against_the_decode_worker():
    pool = [prefill_worker(queued=6000)]  # 4.0 s
    # 6144 tokens of local prompts queued before this one: 32 chunks -> 5.4 s.
    d = policy().place(LONG, [decode_worker(inflight_prefill_tokens=6144)], pool)
    assert d.reason is Reason.REMOTE
    assert policy().place(LONG, [decode_worker()], pool).reason is Reason.LOCAL_BACKLOG


def test_operator_cap_overrides_the_estimate():
    pool = [prefill_worker(queued=6000)]
    assert (
        policy(local_prefill_max_tokens=1024).place(LONG, [decode_worker()], pool).reason
        is Reason.REMOTE
    )
    assert (
        policy(local_prefill_max_tokens=LONG).place(LONG, [decode_worker()], pool).reason
        is Reason.LOCAL_BACKLOG
    )


def test_unmeasured_workers_fall_back_to_the_peer_then_the_default():
    unmeasured = Candidate("d", Capacity(total_blocks=10_000, free_blocks=10_000))
    # Nothing measured anywhere: both at the default rate, a tie -> the prefill pool.
    d = policy().place(LONG, [unmeasured], [prefill_worker(rate=0.0)])
    assert d.reason is Reason.REMOTE and d.estimated_ttft_s == pytest.approx(LONG / 2000)
    # A backed-up pool: the decode worker is assumed as fast as the prefill worker measured.
    d = policy().place(LONG, [unmeasured], [prefill_worker(queued=1000, rate=1000.0)])
    assert d.reason is Reason.LOCAL_BACKLOG
    assert d.estimated_ttft_s == pytest.approx(LONG / 1000)


# ---- the estimates --------------------------------------------------------------------


def test_step_cost_fits_the_measured_steps():
    cost = step_cost(decode_worker().capacity, peer_rate=4000.0, default_rate=1.0)
    assert cost.overhead_s == pytest.approx(0.036)
    assert cost.per_token_s == pytest.approx(0.0005)  # the fit, not the faster peer's rate
    assert cost.seconds(100) == pytest.approx(0.086)
    # A peer that measured whole prompts slower than the fit: its rate is the floor.
    assert step_cost(decode_worker().capacity, 1000.0, 1.0).per_token_s == pytest.approx(0.001)


def test_step_cost_fallbacks():
    assert step_cost(Capacity(), 1000.0, 2000.0) == StepCost(0.0, 0.001)  # the peer
    assert step_cost(Capacity(), 0.0, 2000.0) == StepCost(0.0, 0.0005)  # the default
    own_rate = Capacity(prefill_tokens_per_s=400.0)
    assert step_cost(own_rate, 0.0, 2000.0).per_token_s == pytest.approx(1 / 400)
    # Decode steps measured, no prefill steps: the peer's per-token cost, its own overhead.
    decode_only = Capacity(decode_step_s=0.03, decode_step_tokens=10)
    cost = step_cost(decode_only, 1000.0, 2000.0)
    assert (cost.overhead_s, cost.per_token_s) == pytest.approx((0.02, 0.001))
    # Prefill steps too few tokens apart from decode steps to fit a slope: no fit.
    close = Capacity(
        decode_step_s=0.03,
        decode_step_tokens=10,
        prefill_step_s=0.05,
        prefill_step_tokens=30,
        prefill_tokens_per_s=400.0,
    )
    assert step_cost(close, 1000.0, 2000.0).per_token_s == pytest.approx(0.001)


def test_local_prefill_chunks_by_budget_and_threshold():
    cost = StepCost(0.01, 0.001)
    cap = Capacity(max_num_batched_tokens=100, long_prefill_token_threshold=0)
    # 250 tokens beside 20 decodes: chunks of 80 (the budget left) -> 3 x 0.11 + 0.04; each
    # decode is held up by the prompt's 250 tokens of compute.
    est = local_prefill(cap, 0, 250, 20, cost)
    assert est == LocalEstimate(
        pytest.approx(3 * 0.11 + 0.04), pytest.approx(0.11), pytest.approx(0.25)
    )
    assert local_prefill(cap, 0, 250, 0, cost).decode_delay_s == 0.0  # nothing decoding
    # The threshold caps the chunk: 50 -> 5 steps of 0.08.
    cap = Capacity(max_num_batched_tokens=100, long_prefill_token_threshold=50)
    assert local_prefill(cap, 0, 250, 20, cost).ttft_s == pytest.approx(5 * 0.08)
    # Queued local prompts come first.
    assert local_prefill(cap, 100, 250, 20, cost).ttft_s == pytest.approx(7 * 0.08)
    # Decodes fill the whole budget: no chunk fits.
    assert local_prefill(cap, 0, 250, 100, cost) is None
    # Budget not published: one step for the lot.
    assert local_prefill(Capacity(), 0, 250, 20, cost).ttft_s == pytest.approx(0.28)


# ---- learning what the estimates miss ----------------------------------------------------


def test_correction_learns_each_path_and_forgets_the_unused_one():
    c = TTFTCorrection()
    for _ in range(100):
        c.observe(PrefillPath.REMOTE, estimated_s=1.0, observed_s=1.5)
    assert c.error_s(PrefillPath.REMOTE) == pytest.approx(0.5, abs=1e-3)
    assert c.corrected(PrefillPath.REMOTE, 1.0) == pytest.approx(1.5, abs=1e-3)
    assert c.corrected(PrefillPath.LOCAL, 1.0) == 1.0
    c.observe(PrefillPath.LOCAL, estimated_s=1.0, observed_s=0.5)
    assert c.error_s(PrefillPath.LOCAL) == pytest.approx(-0.05)
    assert c.error_s(PrefillPath.REMOTE) == pytest.approx(0.5 * 0.98, abs=1e-3)
    assert c.corrected(PrefillPath.LOCAL, 0.01) == 0.0  # never below zero


def test_learned_handoff_overhead_changes_the_decision():
    p, d = policy(), decode_worker()  # 1.34 s locally, + 1.02 s stall on its decodes
    pool = [prefill_worker(rate=4000.0)]  # an idle, fast pool: 0.51 s
    assert p.place(LONG, [d], pool).reason is Reason.REMOTE
    # Remote answers turn out 2 s later than estimated (the KV hand-off): now local pays.
    for _ in range(50):
        p.correction.observe(PrefillPath.REMOTE, estimated_s=0.5, observed_s=2.5)
    assert p.place(LONG, [d], pool).reason is Reason.LOCAL_FASTER
    # A few local answers turn out 3 s later than estimated (local: 1.34 + 0.81 + 1.02 s)
    # while the remote correction fades a little (0.51 + 1.88 s): the pool wins again.
    for _ in range(3):
        p.correction.observe(PrefillPath.LOCAL, estimated_s=1.3, observed_s=4.3)
    assert p.place(LONG, [d], pool).reason is Reason.REMOTE
