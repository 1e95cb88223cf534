"""Blocks exchanged with peer workers (engine/kv/block_pool.py `hold_cached`, `reserve`,
`adopt`): what a holder pins (pool blocks as they are, tier blocks promoted), what a puller
reserves and how pulled blocks join its prefix cache — with the free-list accounting that
proves nothing leaks on either side."""

import pytest

from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import KVEvent
from engine.kv.kv_tier import FakeTierStorage, KVTier
from tests.engine.engine_factories import make_request

BS = 4


def cached_once(bm: BlockManager, tokens: list[int], rid: str = "r"):
    """Run a prompt through the pool (allocate, compute, cache, free); its request."""
    request = make_request(tokens, BS, request_id=rid)
    prefix = bm.match_prefix(request)
    assert bm.allocate(request, request.num_tokens - prefix.num_tokens, prefix)
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request)
    bm.free(request)
    return request


def test_holder_pins_pool_blocks_only_until_released():
    bm = BlockManager(8, BS)
    hashes = cached_once(bm, list(range(13))).block_hashes[:3]
    pinned = bm.pool.hold_cached(hashes)
    assert pinned == [bm.pool._cached[0][h] for h in hashes]
    assert bm.pool.num_free_blocks == 8 - 3
    # Pinned blocks are never evicted, however much is allocated meanwhile.
    other = make_request(list(range(100, 120)), BS, request_id="o")
    assert bm.allocate(other, 20, bm.match_prefix(other))
    assert [bm.pool.blocks[b].block_hash for b in pinned] == hashes
    bm.free(other)
    bm.pool.release(pinned)
    assert bm.pool.num_free_blocks == 8 and bm.pool.hold_cached(hashes) is not None


def test_holder_promotes_tier_blocks_and_refuses_what_it_lacks():
    tier = KVTier(FakeTierStorage(4))
    bm = BlockManager(4, BS, tier=tier, record_events=True)
    hashes = cached_once(bm, list(range(13))).block_hashes[:3]
    cached_once(bm, list(range(100, 116)), "evictor")  # 4 blocks: the first 3 go to the tier
    assert all((0, h) in tier for h in hashes)
    bm.pool.take_events()
    assert bm.pool.hold_cached(hashes + [b"unknown" * 4]) is None  # nothing pinned, nothing moved
    assert bm.pool.num_free_blocks == 4 and all((0, h) in tier for h in hashes)
    pinned = bm.pool.hold_cached(hashes)
    assert len(pinned) == 3 and bm.pool.num_free_blocks == 1
    assert [bm.pool.blocks[b].block_hash for b in pinned] == hashes
    assert not any((0, h) in tier for h in hashes)
    promoted = [e for e in bm.pool.take_events() if e.tier == 0 and e.stored]
    assert [e.block_hash for e in promoted] == hashes
    bm.pool.release(pinned)
    assert bm.pool.num_free_blocks == 4


def test_holder_without_room_to_promote_pins_nothing():
    tier = KVTier(FakeTierStorage(4))
    bm = BlockManager(3, BS, tier=tier)
    hashes = cached_once(bm, list(range(9))).block_hashes[:2]
    busy = make_request(list(range(100, 112)), BS, request_id="busy")
    assert bm.allocate(busy, 12, bm.match_prefix(busy))  # every block in use: ours demoted
    assert bm.pool.num_free_blocks == 0 and all((0, h) in tier for h in hashes)
    assert bm.pool.hold_cached(hashes) is None
    assert all((0, h) in tier for h in hashes)


def test_pulled_blocks_join_the_prefix_cache_leaves_first():
    holder, puller = BlockManager(8, BS), BlockManager(8, BS, record_events=True)
    request = cached_once(holder, list(range(13)))
    hashes = request.block_hashes[:3]
    reserved = puller.pool.reserve(3)
    assert puller.pool.num_free_blocks == 5
    assert puller.pool.adopt(hashes, reserved) == 3
    assert puller.pool.num_free_blocks == 8
    assert [e for e in puller.pool.take_events()] == [KVEvent(True, h) for h in hashes]
    again = make_request(list(range(13)), BS, request_id="again")
    assert puller.match_prefix(again).num_tokens == 12  # a prefix hit now
    # Eviction takes the leaf first: the next three pops evict hashes[2], [1], [0] last.
    order = [puller.pool.pop_free(0) for _ in range(8)]
    assert order[-3:] == [reserved[2], reserved[1], reserved[0]]


def test_adopting_what_is_already_held_frees_the_spare_block():
    bm = BlockManager(8, BS)
    hashes = cached_once(bm, list(range(13))).block_hashes[:3]
    reserved = bm.pool.reserve(2)
    assert bm.pool.adopt(hashes[:2], reserved) == 0  # computed here meanwhile
    assert bm.pool.num_free_blocks == 8
    assert all(bm.pool.blocks[b].block_hash is None for b in reserved)


def test_reserve_beyond_the_free_blocks_takes_nothing():
    bm = BlockManager(4, BS)
    assert bm.pool.reserve(5) is None and bm.pool.num_free_blocks == 4
    bm.pool.release(bm.pool.reserve(4))
    assert bm.pool.num_free_blocks == 4


def test_several_kv_groups_are_refused_by_name():
    bm = BlockManager(8, BS, group_windows=(None, 8))
    with pytest.raises(ValueError, match="2 KV groups"):
        bm.pool.reserve(1)
    with pytest.raises(ValueError, match="KV groups"):
        bm.pool.hold_cached([b"x"])
