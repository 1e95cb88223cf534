"""The KV cache's second tier (engine/kv/kv_tier.py): its LRU and capacity, the block manager's
demotions (evicted cached blocks, leaves first) and promotions (a prefix hit in the tier), and
outputs through a tiny random LLaMA that are identical whether a prefix was computed, hit in
the pool or promoted from the tier — and identical to the tier-off engine."""

import dataclasses
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checks import FieldError
from engine.config import EngineConfig, parse_offloading_size
from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import TIER, KVEvent
from engine.kv.kv_pool import kv_block_bytes
from engine.kv.kv_tier import FakeTierStorage, KVTier, tier_slots
from tests.engine.engine_factories import make_request

BS = 4


def make_bm(num_blocks: int, slots: int, **kw) -> tuple[BlockManager, KVTier]:
    tier = KVTier(FakeTierStorage(slots))
    return BlockManager(num_blocks, BS, tier=tier, **kw), tier


def run_once(bm: BlockManager, request) -> None:
    """Allocate the prompt, mark it computed, cache its full blocks, free it."""
    prefix = bm.match_prefix(request)
    assert bm.allocate(request, request.num_tokens - prefix.num_tokens, prefix)
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request)
    bm.free(request)


# ---- the tier alone ------------------------------------------------------------------------


def test_tier_lru_evicts_its_least_recent_entry():
    tier = KVTier(FakeTierStorage(2))
    assert tier.demote((0, b"a"), 10) == (True, [])
    assert tier.demote((0, b"b"), 11) == (True, [])
    tier.touch((0, b"a"))  # a looked up: b is now the oldest
    assert tier.demote((0, b"c"), 12) == (True, [(0, b"b")])
    assert tier.keys() == [(0, b"a"), (0, b"c")]
    assert tier.num_used == 2 and tier.stats.evictions == 1 and tier.stats.demotions == 3


def test_taken_slots_are_not_overwritten_until_loaded():
    storage = FakeTierStorage(1)
    tier = KVTier(storage)
    tier.demote((0, b"a"), 10)
    slot = tier.take((0, b"a"))
    assert tier.demote((0, b"b"), 11) == (False, [])  # the only slot is being promoted
    tier.load(slot, 20)
    assert storage.copies == [("store", 0, 10), ("load", 0, 20)]
    assert tier.num_used == 0 and tier.stats.promotions == 1


def test_capacity_in_whole_blocks_from_bytes():
    assert tier_slots(10 * 4096 + 4095, 4096) == 10
    assert tier_slots(4095, 4096) == 0
    assert parse_offloading_size("2") == 2 << 30  # vLLM's unit: GiB
    assert parse_offloading_size("0.5") == 1 << 29
    assert parse_offloading_size("512MiB") == 512 << 20
    assert parse_offloading_size("12345B") == 12345
    with pytest.raises(ValueError):
        KVTier(FakeTierStorage(0))


def test_config_checks():
    with pytest.raises(FieldError, match="enable_prefix_caching"):
        EngineConfig(kv_offloading_size=1 << 20, enable_prefix_caching=False)
    with pytest.raises(FieldError, match="kv_offloading_path"):
        EngineConfig(kv_offloading_path="/tmp/x")


def test_flag_round_trips_through_argv():
    import argparse

    from engine.config import add_engine_args
    from engine.flags import to_argv

    config = EngineConfig(kv_offloading_size=12345, kv_offloading_path="/tmp/tier")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig.from_args(parser.parse_args(to_argv(config))) == config
    assert (
        EngineConfig.from_args(parser.parse_args(["--kv-offloading-size", "1"])).kv_offloading_size
        == 1 << 30
    )


# ---- the block manager with a tier ---------------------------------------------------------


def test_evicted_blocks_are_demoted_leaves_first_and_promoted_back():
    bm, tier = make_bm(num_blocks=4, slots=8, record_events=True)
    a = make_request(list(range(100, 113)), BS)  # 3 full blocks + 1 token: 4 blocks
    run_once(bm, a)
    hashes = a.block_hashes[:3]
    assert bm.pool.take_events() == [KVEvent(True, h) for h in hashes]
    run_once(bm, make_request(list(range(500, 513)), BS))  # takes the whole pool: evicts a's
    store_order = [blk for op, _, blk in tier.storage.copies if op == "store"]
    table_of = {h: i for i, h in enumerate(hashes)}
    assert [table_of[h] for g, h in tier.keys() if h in table_of] == [2, 1, 0]  # leaves first
    assert len(store_order) == 3
    assert KVEvent(True, hashes[2], tier=1) in bm.pool.take_events()  # still held, in the tier

    again = make_request(list(range(100, 113)), BS)
    prefix = bm.match_prefix(again)
    assert prefix.num_tokens == 12 and prefix.block_ids == [[TIER] * 3]
    assert bm.allocate(again, 1, prefix)
    table = bm.block_table(again.request_id)
    assert [bm.pool.blocks[b].block_hash for b in table[:3]] == hashes  # registered as cached
    assert all((0, h) not in tier for h in hashes)  # exclusive: moved, not copied
    assert tier.stats.promotions == 3 and tier.stats.hit_tokens == 12
    assert bm.stats.hits == 12
    bm.free(again)
    assert bm.pool.num_free_blocks == 4
    assert tier.num_used == len(tier.keys())  # no slot held by a finished promotion


def test_mixed_hit_pool_then_tier():
    bm, tier = make_bm(num_blocks=6, slots=8)
    a = make_request(list(range(100, 117)), BS)  # 4 full blocks + 1
    run_once(bm, a)
    # Evict exactly the two leaves of a: the free list is a's uncached last block, the
    # never-used one, then a's cached blocks leaf first.
    b = make_request(list(range(600, 616)), BS)
    assert bm.allocate(b, 16, bm.match_prefix(b))  # 4 blocks: 2 uncached + a's 2 leaves
    assert sorted(h for _, h in tier.keys()) == sorted(a.block_hashes[2:4])
    bm.free(b)
    again = make_request(list(range(100, 117)), BS)
    prefix = bm.match_prefix(again)
    assert prefix.num_tokens == 16
    assert prefix.block_ids[0][2:] == [TIER, TIER] and TIER not in prefix.block_ids[0][:2]
    assert bm.allocate(again, 1, prefix)
    assert tier.stats.hit_tokens == 8
    bm.free(again)


def test_full_tier_drops_its_oldest_and_announces_it():
    bm, tier = make_bm(num_blocks=3, slots=2, record_events=True)
    a = make_request(list(range(100, 109)), BS)  # 2 full blocks + 1
    run_once(bm, a)
    bm.pool.take_events()
    run_once(bm, make_request(list(range(300, 309)), BS))  # demotes a's 2 blocks
    assert {h for _, h in tier.keys()} == set(a.block_hashes[:2])
    bm.pool.take_events()
    run_once(bm, make_request(list(range(700, 709)), BS))  # demotes the 2nd: a's are dropped
    events = bm.pool.take_events()
    assert (
        KVEvent(False, a.block_hashes[0]) in events and KVEvent(False, a.block_hashes[1]) in events
    )
    assert set(bm.pool.cached_hashes()) == set(bm.pool._cached[0]) | {h for _, h in tier.keys()}
    assert len(tier.keys()) == 2 and tier.stats.evictions == 2


def test_recomputed_block_leaves_the_tier_and_reset_clears_it():
    bm, tier = make_bm(num_blocks=3, slots=4, record_events=True)
    a = make_request(list(range(100, 109)), BS)
    run_once(bm, a)
    run_once(bm, make_request(list(range(300, 309)), BS))
    assert len(tier.keys()) == 2
    # A request that computes its whole prompt (prompt logprobs) bypasses the hit: once it
    # caches the same blocks in the pool, the tier forgets its copies.
    again = make_request(list(range(100, 109)), BS)
    again.sampling = dataclasses.replace(again.sampling, prompt_logprobs=1)
    assert again.computes_whole_prompt
    run_once(bm, again)
    assert not any(h in a.block_hashes for _, h in tier.keys())
    bm.pool.take_events()
    bm.reset_prefix_cache()
    assert tier.keys() == [] and tier.num_used == 0
    assert not any(e.stored for e in bm.pool.take_events())


def test_sliding_groups_demote_and_promote_per_group():
    """Two groups (full + window 4): each group's blocks are demoted under (group, hash) and
    a hit promotes what each group needs (a sliding group only its window's blocks)."""
    bm, tier = make_bm(num_blocks=16, slots=32, group_windows=(None, 4))
    a = make_request(list(range(100, 117)), BS)  # 4 full blocks + 1 token
    prefix = bm.match_prefix(a)
    assert bm.allocate(a, a.num_tokens, prefix)
    for upto in range(4, a.num_tokens + 1, 4):  # compute in chunks: the window slides
        a.num_computed_tokens = upto
        bm.cache_full_blocks(a)
        bm.release_slid_out(a)
    bm.free(a)
    run_once(bm, make_request(list(range(400, 429)), BS))  # 8 blocks x 2 groups: the pool
    groups = {g for g, h in tier.keys() if h in a.block_hashes}
    assert groups == {0, 1}
    again = make_request(list(range(100, 117)), BS)
    prefix = bm.match_prefix(again)
    assert prefix.num_tokens == 16
    assert bm.allocate(again, 1, prefix)
    tables = bm.block_tables(again.request_id)
    for g in (0, 1):
        held = [bm.pool.blocks[b].block_hash for b in tables[g][:4] if b >= 0]
        assert held == [h for h in a.block_hashes[4 - len(held) : 4]]
    bm.free(again)


# ---- through the engine, on a tiny random LLaMA -------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
BLOCK = 8
PREFIX = list(range(1000, 1000 + 5 * BLOCK + 3))  # 5 full blocks + 3 tokens
FILLERS = [list(range(3000 + 100 * i, 3000 + 100 * i + 5 * BLOCK + 3)) for i in range(3)]


@pytest.fixture(scope="module")
def tiny_llama(model_dir, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            tie_word_embeddings=True,
        )
    )
    out = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(model_dir / name, out / name)
    return str(out)


def _block_bytes(model: str) -> int:
    import json
    from pathlib import Path

    from engine.models.config import ModelArgs

    args = ModelArgs.from_hf_config(json.loads((Path(model) / "config.json").read_text()))
    return kv_block_bytes(args, BLOCK, torch.float32)


def _llm(model: str, pool_blocks: int, tier_blocks: int = 0, **kw) -> LLM:
    bb = _block_bytes(model)
    return LLM(
        model,
        dtype="float32",
        block_size=BLOCK,
        kv_cache_memory=pool_blocks * bb,
        kv_offloading_size=tier_blocks * bb,
        max_num_seqs=1,
        **kw,
    )


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True, logprobs=0)


def _gen(llm: LLM, prompt, params):
    """(token ids with their logprobs, cached prompt tokens): the logprobs see any change in
    the KV a random tiny model's greedy tokens might not."""
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    completion = out.outputs[0]
    return [(lp.token_id, lp.logprob) for lp in completion.logprobs], out.num_cached_tokens


def _tokens(out: list[tuple[int, float]]) -> list[int]:
    return [t for t, _ in out]


def _logprobs(out: list[tuple[int, float]]) -> list[float]:
    return [lp for _, lp in out]


def _pool_hashes(llm: LLM) -> set:
    return set(llm.engine.block_manager.pool._cached[0])


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_promoted_prefix_gives_the_same_tokens(tiny_llama, params):
    """Tokens are identical whichever way the prefix's KV came; logprobs are identical
    between runs that computed the same positions (a cold run and a hit differ in the last
    float bits: the suffix attends over the cache in another order)."""
    # Reference: tier off, a pool big enough that nothing is evicted.
    ref = _llm(tiny_llama, pool_blocks=64)
    cold, _ = _gen(ref, PREFIX, params)
    warm, warm_cached = _gen(ref, PREFIX, params)  # a pool hit, never evicted
    assert _tokens(warm) == _tokens(cold) and warm_cached == 5 * BLOCK
    assert _logprobs(warm) == pytest.approx(_logprobs(cold), rel=1e-4)

    # Tier on, a pool of 7 blocks: every filler evicts the previous prompt's blocks.
    llm = _llm(tiny_llama, pool_blocks=7, tier_blocks=32)
    assert _gen(llm, PREFIX, params) == (cold, 0)
    bm, tier = llm.engine.block_manager, llm.engine.block_manager.pool.tier
    for filler in FILLERS:
        _gen(llm, filler, params)
    prefix_hashes = set(_prefix_hashes(llm))
    assert not prefix_hashes & _pool_hashes(llm)  # gone from the pool ...
    assert prefix_hashes <= {h for _, h in tier.keys()}  # ... held by the tier
    promoted, cached = _gen(llm, PREFIX, params)
    assert promoted == warm and cached == 5 * BLOCK  # the tier hit counts as cached
    stats = llm.engine.stats()
    assert stats.kv_offload_promotions == 5 and stats.kv_offload_hits == 5 * BLOCK
    assert stats.kv_offload_demotions >= 5 and stats.kv_offload_blocks == 32
    assert bm.pool.num_free_blocks == bm.pool.num_blocks and tier.num_used == len(tier.keys())

    # Tier off under the same small pool: recomputed, same tokens.
    off = _llm(tiny_llama, pool_blocks=7)
    _gen(off, PREFIX, params)
    for filler in FILLERS:
        _gen(off, filler, params)
    assert _gen(off, PREFIX, params) == (cold, 0)


def _prefix_hashes(llm: LLM) -> list:
    return llm.engine.make_request("probe", PREFIX, GREEDY).block_hashes[:5]


def test_file_backed_tier_and_aborts_leave_nothing_held(tiny_llama, tmp_path):
    path = tmp_path / "tier.bin"
    llm = _llm(tiny_llama, pool_blocks=7, tier_blocks=16, kv_offloading_path=str(path))
    cold, _ = _gen(llm, PREFIX, GREEDY)
    _gen(llm, FILLERS[0], GREEDY)
    assert path.stat().st_size >= 16 * _block_bytes(tiny_llama)
    engine = llm.engine
    engine.add_request("r", PREFIX, GREEDY)
    engine.step()  # promoted and prefilled, then aborted
    # The filler took 6 of 7 blocks: the prefix's root is still in the pool, its other 4
    # full blocks come from the tier (a mixed hit).
    assert engine.block_manager.pool.tier.stats.promotions == 4
    assert engine.block_manager.stats.hits == 5 * BLOCK
    engine.abort_request("r")
    bm, tier = engine.block_manager, engine.block_manager.pool.tier
    assert bm.pool.num_free_blocks == bm.pool.num_blocks and tier.num_used == len(tier.keys())
    again, cached = _gen(llm, PREFIX, GREEDY)
    assert _tokens(again) == _tokens(cold) and _logprobs(again) == pytest.approx(
        _logprobs(cold), rel=1e-4
    )
    assert cached == 5 * BLOCK


def test_tier_off_is_unchanged(tiny_llama):
    """The flag's default builds no tier and the block manager drops what it evicts."""
    llm = _llm(tiny_llama, pool_blocks=7)
    assert llm.engine.block_manager.pool.tier is None
    assert llm.engine.config == EngineConfig(
        model=tiny_llama,
        dtype="float32",
        block_size=BLOCK,
        kv_cache_memory=7 * _block_bytes(tiny_llama),
        max_num_seqs=1,
    )
    assert llm.engine.stats().kv_offload_blocks == 0


def test_a_hit_in_one_group_is_never_popped_for_another():
    """Tier off: allocate takes every group's hit blocks before it pops new ones (before, a
    group's new blocks could be popped from another group's hit, which then sat in two
    tables)."""
    bm = BlockManager(16, BS, group_windows=(None, None))
    a = make_request(list(range(100, 109)), BS)  # 2 cached blocks per group
    run_once(bm, a)
    run_once(bm, make_request(list(range(300, 317)), BS))  # cached after a's: evicted later
    b = make_request(list(range(100, 108)) + list(range(900, 917)), BS)
    prefix = bm.match_prefix(b)
    assert prefix.num_tokens == 8
    assert bm.allocate(b, b.num_tokens - 8, prefix)  # 5 new per group + a's 4 hit blocks
    used = [x for table in bm.block_tables(b.request_id) for x in table]
    assert len(used) == len(set(used)) == 14
    assert bm.block_tables(b.request_id)[1][:2] == prefix.block_ids[1]
    bm.free(b)
