"""Swap on preemption (engine/core/swap_policy.py, BlockManager.swap_out) and the tier's batched
copies: a preempted request's partial last block goes to the KV tier and comes back when it
resumes; outputs through a tiny random LLaMA are the same swapped, recomputed, or never
preempted; nothing stays held in the pool or the tier after requests finish or are aborted
while swapped out."""

import pytest

from engine import LLM, SamplingParams
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.swap_policy import SwapPolicy
from engine.kv.block_manager import BlockManager
from engine.kv.kv_tier import CopyTimes, FakeTierStorage, KVTier
from tests.engine import test_kv_offload
from tests.engine.engine_factories import make_request, step
from tests.engine.test_kv_offload import BLOCK, _block_bytes

tiny_llama = test_kv_offload.tiny_llama  # the fixture: a tiny random LLaMA checkpoint

BS = 4


def _always_swap(monkeypatch) -> None:
    monkeypatch.setattr(SwapPolicy, "swap", lambda self, partial, groups: partial > 0)


def _never_swap(monkeypatch) -> None:
    monkeypatch.setattr(SwapPolicy, "swap", lambda self, partial, groups: False)


def _no_leaks(bm: BlockManager) -> None:
    tier = bm.pool.tier
    assert bm.pool.num_free_blocks == bm.pool.num_blocks and not bm._swapped
    assert tier.num_used == len(tier.keys())  # every held slot is an LRU entry: no swap left


# ---- the policy ----------------------------------------------------------------------------


def test_policy_weighs_measured_copies_against_measured_prefill():
    times = CopyTimes()
    policy = SwapPolicy(times)
    assert not policy.swap(7, 1)  # nothing measured: recompute
    times.observe("store_s", 2e-4, 2)  # 100 us per block
    times.observe("load_s", 1e-4, 2)  # 50 us
    assert not policy.swap(7, 1)  # prefill not measured yet
    policy.observe_prefill(10.0, 1)  # the first (warm-up) step is not counted
    policy.observe_prefill(1e-3, 100)  # 10 us per token
    assert policy.prefill_s_per_token == pytest.approx(1e-5)
    assert policy.swap(16, 1) and not policy.swap(15, 1)  # 150 us of copies vs 10 us a token
    assert not policy.swap(16, 2)  # two groups: two blocks each way
    assert not SwapPolicy(None).swap(16, 1)  # no tier


# ---- the block manager and scheduler with a fake tier ---------------------------------------


def test_swap_out_and_in_through_the_scheduler(monkeypatch):
    """A preempted request resumes at its computed tokens: its full blocks are a prefix hit,
    its partial block is swapped back into the next table entry."""
    _always_swap(monkeypatch)
    tier = KVTier(FakeTierStorage(16))
    bm = BlockManager(7, BS, tier=tier)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    first = make_request(list(range(300, 309)), BS, max_tokens=8)
    second = make_request(list(range(400, 411)), BS, max_tokens=8)  # preempted mid-block
    s.add_request(first)
    s.add_request(second)
    swapped_at, resumed = None, 0
    while s.has_unfinished():
        out = step(s)
        scheduled = dict((r.request_id, n) for r, n in out.scheduled)
        if swapped_at and second.request_id in scheduled:  # the step it resumed in
            assert scheduled[second.request_id] == 1  # its last token only (recomputing: 2)
            swapped_at, resumed = None, resumed + 1
        for victim in out.preempted:
            assert victim is second and victim.status is RequestStatus.PREEMPTED
            swapped_at = bm._swapped[victim.request_id]
            assert swapped_at % BS and tier.has_swapped((0, victim.request_id))
            stored = [c for c in tier.storage.copies if c[0] == "store"]
            assert stored[-1][2] == second.block_tables[0][swapped_at // BS]  # the partial block
    assert resumed >= 1 and tier.stats.swap_outs == tier.stats.swap_ins == resumed
    assert second.num_output_tokens == 8
    _no_leaks(bm)


def _swapped_out(bm: BlockManager, tokens: list[int]):
    """A request whose prompt is computed, then preempted with swap."""
    r = make_request(tokens, BS)
    assert bm.allocate(r, len(tokens), bm.match_prefix(r))
    r.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(r)
    assert bm.swap_out(r)
    return r


def test_swap_is_not_used_when_its_full_blocks_are_gone_and_abort_frees_it():
    tier = KVTier(FakeTierStorage(4))
    bm = BlockManager(8, BS, tier=tier)
    r = _swapped_out(bm, list(range(100, 111)))  # 2 full blocks + 3 tokens
    assert tier.num_used == 1 and tier.stats.swap_outs == 1
    prefix = bm.match_prefix(r)
    assert (prefix.num_tokens, prefix.swapped) == (11, 3)  # every block still cached
    # Forget the pool's copies of its full blocks: the partial block alone cannot resume.
    bm.reset_prefix_cache()
    assert not bm._swapped and tier.num_used == 0  # reset drops swaps too (new weights)
    assert bm.match_prefix(r).num_tokens == 0

    r2 = _swapped_out(bm, list(range(200, 211)))
    bm.free(r2)  # finished (aborted) while swapped out
    _no_leaks(bm)


def test_a_swapped_requests_full_blocks_outlive_the_tiers_lru():
    """Its full blocks, demoted while it waits, are pinned: the full tier evicts other
    entries (they were older and would go first), and it resumes by swap-in."""
    tier = KVTier(FakeTierStorage(4))
    bm = BlockManager(3, BS, tier=tier)
    r = _swapped_out(bm, list(range(100, 109)))  # 2 full blocks + 1 token
    for i in range(4):  # each takes the pool: demotes what is there, then the tier is full
        test_kv_offload.run_once(bm, make_request(list(range(300 + 20 * i, 309 + 20 * i)), BS))
    assert {(0, h) for h in r.block_hashes[:2]} <= set(tier.keys())
    assert tier.stats.evictions > 0
    prefix = bm.match_prefix(r)
    assert (prefix.num_tokens, prefix.swapped) == (9, 1)
    assert bm.allocate(r, 1, prefix)
    assert tier.stats.swap_ins == 1 and not tier._pinned
    bm.free(r)
    _no_leaks(bm)


def test_sliding_groups_swap_their_partial_blocks_too():
    """Two groups (full + window 4): each group's partial block is swapped out and back into
    the resumed request's next table entry; the sliding group keeps only its window."""
    tier = KVTier(FakeTierStorage(32))
    bm = BlockManager(16, BS, tier=tier, group_windows=(None, 4))
    r = make_request(list(range(100, 115)), BS)  # 3 full blocks + 3 tokens
    assert bm.allocate(r, 15, bm.match_prefix(r))
    r.num_computed_tokens = 15
    bm.cache_full_blocks(r)
    bm.release_slid_out(r)
    partial_blocks = [table[3] for table in bm.block_tables(r.request_id)]
    assert bm.swap_out(r)
    assert {blk for op, _, blk in tier.storage.copies if op == "store"} == set(partial_blocks)
    prefix = bm.match_prefix(r)
    assert (prefix.num_tokens, prefix.swapped) == (15, 3)
    assert bm.allocate(r, 1, prefix)
    tables = bm.block_tables(r.request_id)
    loads = [(slot, blk) for op, slot, blk in tier.storage.copies if op == "load"]
    assert sorted(blk for _, blk in loads) == sorted(table[3] for table in tables)
    assert tables[1][:3] == [-1] * 3  # a query at 15 with window 4 reads positions 12.. only
    assert tier.stats.swap_ins == 1
    bm.free(r)
    _no_leaks(bm)


def test_a_steps_copies_run_as_one_gathered_store_and_one_load():
    storage = FakeTierStorage(16)
    tier = KVTier(storage)
    bm = BlockManager(6, BS, tier=tier)
    a = make_request(list(range(100, 117)), BS)  # 4 full blocks + 1
    assert bm.allocate(a, 17, bm.match_prefix(a))
    a.num_computed_tokens = 17
    bm.cache_full_blocks(a)
    bm.free(a)
    b = make_request(list(range(500, 521)), BS)  # evicts all of a's blocks
    with bm.pool.copies_batched():
        assert bm.allocate(b, 21, bm.match_prefix(b))
        assert storage.batches == []  # queued until the batch ends
    assert storage.batches == [("store", 4)]
    b.num_computed_tokens = 21
    bm.cache_full_blocks(b)
    bm.free(b)
    again = make_request(list(range(100, 117)), BS)
    with bm.pool.copies_batched():  # promotes a's 4 blocks, demotes b's blocks it evicts
        assert bm.allocate(again, 1, bm.match_prefix(again))
    assert storage.batches[1:] == [("store", 4), ("load", 4)]  # stores first
    assert tier.copy_times.store_s > 0 and tier.copy_times.load_s > 0
    bm.free(again)
    assert tier.num_used == len(tier.keys())


# ---- through the engine, on a tiny random LLaMA -------------------------------------------


def _llm(model: str, pool_blocks: int, tier_blocks: int = 0, max_num_seqs: int = 2) -> LLM:
    bb = _block_bytes(model)
    return LLM(
        model,
        dtype="float32",
        block_size=BLOCK,
        kv_cache_memory=pool_blocks * bb,
        kv_offloading_size=tier_blocks * bb,
        max_num_seqs=max_num_seqs,
    )


# 21 and 22 tokens: the second is preempted mid-block (a partial block to swap).
PROMPTS = [list(range(1000 + 50 * i, 1000 + 50 * i + 2 * BLOCK + 5 + i)) for i in range(2)]


def _run(llm: LLM, params: SamplingParams):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs] for o in outs]


def _same(got, ref) -> None:
    for g, r in zip(got, ref):
        assert [t for t, _ in g] == [t for t, _ in r]
        assert [lp for _, lp in g] == pytest.approx([lp for _, lp in r], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=14, temperature=1.0, seed=7, ignore_eos=True, logprobs=0),
    ],
    ids=["greedy", "seeded"],
)
def test_swapped_recomputed_and_unpreempted_outputs_agree(tiny_llama, params, monkeypatch):
    ref = _run(_llm(tiny_llama, pool_blocks=64), params)

    _always_swap(monkeypatch)
    # 21 + 22 + 2 x 14 tokens need 10 blocks of 8; the pool has 7: the second is preempted.
    swap = _llm(tiny_llama, pool_blocks=7, tier_blocks=32)
    got = _run(swap, params)
    stats = swap.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_offload_swap_outs > 0
    assert stats.kv_offload_swap_ins == stats.kv_offload_swap_outs
    _same(got, ref)
    _no_leaks(swap.engine.block_manager)

    _never_swap(monkeypatch)
    recompute = _llm(tiny_llama, pool_blocks=7, tier_blocks=32)
    got = _run(recompute, params)
    stats = recompute.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_offload_swap_outs == 0
    _same(got, ref)


def test_abort_while_swapped_out_leaves_nothing_held(tiny_llama, monkeypatch):
    _always_swap(monkeypatch)
    llm = _llm(tiny_llama, pool_blocks=7, tier_blocks=32)
    engine = llm.engine
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    bm = engine.block_manager
    while not bm._swapped:
        engine.step()
    (rid,) = bm._swapped
    assert bm.pool.tier.num_used > len(bm.pool.tier.keys())  # the swapped-out block holds a slot
    engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    _no_leaks(bm)
    assert engine.stats().kv_offload_swap_ins == 0


def test_the_engine_measures_its_rates(tiny_llama):
    llm = _llm(tiny_llama, pool_blocks=64, tier_blocks=8)
    policy = llm.engine.scheduler.swap_policy
    assert policy.copy_times.store_s > 0 and policy.copy_times.load_s > 0  # measured at start
    for prompt in PROMPTS:  # the first prefill step is a warm-up: not counted
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert policy.prefill_s_per_token > 0
