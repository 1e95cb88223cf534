"""The block pool hands out runs of adjacent blocks (BlockPool.pop_many) without breaking its
invariants: the blocks evicted are those per-block pops would evict, never-cached blocks go
first, nothing leaks; and the tier copies a run with one memmove."""

import copy
import random

import pytest
import torch

from engine.kv.block_hash import extend_block_hashes
from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import BlockPool
from engine.kv.kv_tier import KVTier
from engine.kv.kv_tier_storage import FakeTierStorage, HostTierStorage, block_runs
from tests.engine.engine_factories import make_request

BS = 4


def runs(ids):
    return 1 + sum(1 for a, b in zip(ids, ids[1:]) if b != a + 1)


def check_invariants(pool: BlockPool) -> None:
    free = set(pool._free)
    assert free == {b.block_id for b in pool.blocks if b.ref_count == 0}
    for g, cached in enumerate(pool._cached):
        for h, block_id in cached.items():
            assert pool.blocks[block_id].block_hash == h and pool.blocks[block_id].group == g
    cached_free = [b for b in pool._free if pool.blocks[b].block_hash is not None]
    spare_free = [b for b in pool._free if pool.blocks[b].block_hash is None]
    assert list(pool._free)[: len(spare_free)] == spare_free  # never-cached ones first
    assert len(cached_free) + len(spare_free) == pool.num_free_blocks


def hashes(n, seed=0):
    out = []
    extend_block_hashes(out, [seed * 1000 + i for i in range(n * BS)], BS, b"")
    return out


def test_a_fresh_pool_gives_one_run():
    pool = BlockPool(128)
    assert pool.pop_many(0, 64) == list(range(64))
    assert pool.pop_many(0, 8, after=63) == list(range(64, 72))
    check_invariants(pool)


def test_spare_blocks_scattered_in_the_free_list_come_back_as_runs():
    pool = BlockPool(16)
    taken = pool.pop_many(0, 16)
    pool.release([taken[i] for i in (10, 2, 11, 3, 4)])  # front: 4, 3, 11, 2, 10
    assert pool.pop_many(0, 5) == [2, 3, 4, 10, 11]
    check_invariants(pool)


def test_cached_blocks_released_in_reverse_come_back_ascending_and_evict_the_same_set():
    pool = BlockPool(16)
    ids = pool.pop_many(0, 16)
    for h, b in zip(hashes(16), ids):
        pool.cache_block(0, h, b)
    pool.release(list(reversed(ids[4:12])))  # a table freed leaves first: 11, 10, ..., 4
    reference = copy.deepcopy(pool)
    per_block = {reference.pop_free(0) for _ in range(5)}
    got = pool.pop_many(0, 5)
    assert got == sorted(per_block) == [7, 8, 9, 10, 11]
    assert set(pool._cached[0].values()) == set(reference._cached[0].values())
    check_invariants(pool)


def test_after_churn_allocation_is_correct_runs_where_possible_and_nothing_leaks():
    rng = random.Random(0)
    pool = BlockPool(256)
    held: list[list[int]] = []
    seed = 0
    for _ in range(400):
        k = rng.randint(1, 24)
        if pool.num_free_blocks >= k:
            reference = copy.deepcopy(pool)
            for _ in range(k):
                reference.pop_free(0)
            ids = pool.pop_many(0, k)
            assert len(set(ids)) == k and ids == sorted(ids)
            # Cached blocks evicted: exactly those per-block pops would evict.
            assert set(pool._cached[0].values()) == set(reference._cached[0].values())
            held.append(ids)
        if held and rng.random() < 0.55:
            ids = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.5:  # some become cached prefixes
                seed += 1
                for h, b in zip(hashes(len(ids), seed), ids):
                    pool.cache_block(0, h, b)
            pool.release(list(reversed(ids)))
        check_invariants(pool)
    for ids in held:
        pool.release(ids)
    assert pool.num_free_blocks == 256
    check_invariants(pool)


def test_a_prompt_allocated_on_a_churned_manager_takes_few_runs():
    bm = BlockManager(128, BS)
    a = make_request(list(range(64 * BS)), BS, request_id="a")
    b = make_request(list(range(5000, 5000 + 32 * BS)), BS, request_id="b")
    for r in (a, b):
        assert bm.allocate(r, r.num_tokens, bm.match_prefix(r))
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_blocks(r)
    bm.free(a)  # cached-free, released leaves first: 63, 62, ..., 0 at the back
    c = make_request(list(range(9000, 9000 + 96 * BS)), BS, request_id="c")
    assert bm.allocate(c, c.num_tokens, bm.match_prefix(c))
    table = bm.block_table("c")
    assert sorted(table) == table and runs(table) == 2  # 96..127 never cached, then 0..63
    bm.free(b)
    bm.free(c)
    assert bm.pool.num_free_blocks == 128


def test_a_growing_table_stays_one_run():
    bm = BlockManager(64, BS)
    r = make_request(list(range(4 * BS)), BS, request_id="r")
    x = make_request(list(range(100, 100 + 2 * BS)), BS, request_id="x")
    y = make_request(list(range(200, 200 + 2 * BS)), BS, request_id="y")
    for req in (r, x, y):
        assert bm.allocate(req, req.num_tokens, bm.match_prefix(req))
    assert bm.block_table("r") == [0, 1, 2, 3]
    bm.free(x)
    bm.free(y)  # the free list now starts 6, 7, 4, 5, 8, ...
    r.num_computed_tokens = r.num_tokens
    assert bm.append_slots(r, 3 * BS)
    assert bm.block_table("r") == list(range(7))


def test_promotions_take_a_run():
    tier = KVTier(FakeTierStorage(8))
    pool = BlockPool(8, tier=tier)
    ids = pool.pop_many(0, 4)
    hs = hashes(4)
    for h, b in zip(hs, ids):
        pool.cache_block(0, h, b)
    pool.release(list(reversed(ids)))
    pool.pop_many(0, 8)  # evicts all four cached blocks into the tier
    pool.release(list(range(8)))
    got = pool.promote([(0, h) for h in hs])
    assert runs(got) == 1 and [pool.lookup(0, h) for h in hs] == got
    check_invariants(pool)


def test_block_runs_merge_pairs_adjacent_on_both_sides():
    assert block_runs([5, 6, 7, 1, 9], [10, 11, 12, 3, 14]) == [(1, 3, 1), (5, 10, 3), (9, 14, 1)]
    assert block_runs([], []) == []


@pytest.mark.parametrize("fragmented", [False, True])
def test_tier_copies_by_runs_are_byte_exact(fragmented):
    pool = torch.randn(32, 2, 2, BS, 3, 8)
    storage = HostTierStorage(pool, 24)
    rng = random.Random(1)
    blocks = rng.sample(range(32), 12) if fragmented else list(range(4, 16))
    slots = rng.sample(range(24), 12) if fragmented else list(range(12))
    storage.store_many(slots, blocks)
    assert torch.equal(storage.slots[slots], pool[blocks])
    target = list(range(20, 32))
    storage.load_many(slots, target)
    assert torch.equal(pool[target], storage.slots[slots])
