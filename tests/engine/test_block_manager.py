import pytest
from engine_factories import make_request

from engine.kv.block_hash import compute_block_hashes
from engine.kv.block_manager import BlockManager

BS = 4


def _admit(bm: BlockManager, request, num_new=None):
    prefix = bm.match_prefix(request)
    n = request.num_tokens - prefix.num_tokens if num_new is None else num_new
    assert bm.allocate(request, n, prefix)
    request.num_computed_tokens = prefix.num_tokens + n
    bm.cache_full_blocks(request)
    return prefix


def test_allocate_and_free_restore_the_free_list():
    bm = BlockManager(8, BS)
    r = make_request(10, BS)
    _admit(bm, r)
    assert len(bm.block_table(r.request_id)) == 3  # 10 tokens -> 3 blocks
    assert bm.pool.num_free_blocks == 5
    assert all(bm.pool.blocks[b].ref_count == 1 for b in bm.block_table(r.request_id))
    bm.free(r)
    assert bm.pool.num_free_blocks == 8 and not bm.has_table(r.request_id)


def test_allocate_fails_cleanly_when_the_pool_is_short():
    bm = BlockManager(2, BS)
    r = make_request(12, BS)
    prefix = bm.match_prefix(r)
    assert not bm.allocate(r, 12, prefix)
    assert bm.pool.num_free_blocks == 2 and not bm.has_table(r.request_id)


def test_lazy_growth_one_block_at_a_time():
    bm = BlockManager(8, BS)
    r = make_request(4, BS)
    _admit(bm, r)
    assert len(bm.block_table(r.request_id)) == 1
    for token in range(5):
        r.append_token(token)
        assert bm.append_slots(r, 1)
        r.num_computed_tokens += 1
        assert len(bm.block_table(r.request_id)) == -(-r.num_tokens // BS)
    bm.free(r)


@pytest.mark.parametrize("diverge_at", range(0, 13))
def test_prefix_hits_stop_at_the_first_divergent_block(diverge_at):
    bm = BlockManager(16, BS)
    base = list(range(1, 14))  # 13 tokens: 3 full blocks + 1
    first = make_request(base, BS)
    _admit(bm, first)
    other = list(base)
    other[diverge_at] = 999
    second = make_request(other, BS)
    prefix = bm.match_prefix(second)
    assert prefix.num_tokens == (diverge_at // BS) * BS
    assert prefix.block_ids[0] == bm.block_table(first.request_id)[: diverge_at // BS]
    _admit(bm, second)
    for b in prefix.block_ids[0]:
        assert bm.pool.blocks[b].ref_count == 2
    assert bm.stats.hits == prefix.num_tokens
    bm.free(first)
    bm.free(second)


def test_full_prompt_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(16, BS)
    first = make_request(8, BS)
    _admit(bm, first)
    second = make_request(8, BS)
    assert bm.match_prefix(second).num_tokens == 4  # not 8: the last token needs logits
    bm.free(first)


def test_freed_cached_blocks_are_reused_by_later_hits():
    bm = BlockManager(8, BS)
    first = make_request(9, BS)
    _admit(bm, first)
    table = bm.block_table(first.request_id)[:2]
    bm.free(first)
    assert bm.pool.num_free_blocks == 8
    second = make_request(9, BS)
    prefix = _admit(bm, second)
    assert prefix.block_ids[0] == table
    bm.free(second)


def test_cache_salt_isolates_tenants():
    bm = BlockManager(16, BS)
    a = make_request(12, BS, cache_salt="tenant-a")
    _admit(bm, a)
    assert bm.match_prefix(make_request(12, BS, cache_salt="tenant-b")).num_tokens == 0
    assert bm.match_prefix(make_request(12, BS)).num_tokens == 0
    assert bm.match_prefix(make_request(12, BS, cache_salt="tenant-a")).num_tokens == 8
    bm.free(a)


def test_eviction_is_lru_and_leaves_before_roots():
    bm = BlockManager(6, BS)
    old = make_request([1] * 8 + [5], BS)  # 2 full blocks (+1 partial)
    new = make_request([2] * 8 + [5], BS)
    _admit(bm, old)
    bm.free(old)
    _admit(bm, new)
    bm.free(new)
    old_root, old_leaf = compute_block_hashes(old.token_ids, BS)
    new_root, _ = compute_block_hashes(new.token_ids, BS)
    # Fill the pool: the two never-cached free blocks go first, then old's leaf, then its root.
    hog = make_request(list(range(500, 500 + 4 * 2)), BS)  # 2 blocks
    _admit(bm, hog)
    cached = set(bm.pool.cached_hashes())
    assert {old_root, old_leaf, new_root} <= cached
    hog2 = make_request(list(range(600, 604)), BS)
    _admit(bm, hog2)
    cached = set(bm.pool.cached_hashes())
    assert old_leaf not in cached and old_root in cached and new_root in cached
    hog3 = make_request(list(range(700, 704)), BS)
    _admit(bm, hog3)
    cached = set(bm.pool.cached_hashes())
    assert old_root not in cached and new_root in cached
    for r in (hog, hog2, hog3):
        bm.free(r)


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(8, BS)
    parent = make_request(6, BS, n=2)  # 1 full + 1 partial block
    _admit(bm, parent)
    child = make_request(6, BS, request_id="child")
    child.num_computed_tokens = parent.num_computed_tokens
    bm.fork(parent, child)
    shared = list(bm.block_table(parent.request_id))
    assert bm.block_table(child.request_id) == shared
    assert all(bm.pool.blocks[b].ref_count == 2 for b in shared)
    # Parent writes position 6 (inside the shared partial block): it gets a private copy.
    parent.append_token(11)
    assert bm.append_slots(parent, 1)
    assert bm.take_copies() == [(shared[1], bm.block_table(parent.request_id)[1])]
    assert bm.block_table(parent.request_id)[0] == shared[0]
    assert bm.pool.blocks[shared[1]].ref_count == 1 and bm.pool.blocks[shared[0]].ref_count == 2
    # The child is now the only owner of the old partial block: no copy for it.
    child.append_token(12)
    assert bm.append_slots(child, 1)
    assert bm.take_copies() == []
    bm.free(parent)
    bm.free(child)


def test_reset_prefix_cache_forgets_everything():
    bm = BlockManager(8, BS)
    r = make_request(9, BS)
    _admit(bm, r)
    bm.free(r)
    assert bm.pool.cached_hashes()
    bm.reset_prefix_cache()
    assert not bm.pool.cached_hashes()
    assert bm.match_prefix(make_request(9, BS)).num_tokens == 0


def test_events_report_stores_and_evictions():
    bm = BlockManager(2, BS, record_events=True)
    r = make_request(5, BS)
    _admit(bm, r)
    bm.free(r)
    stored = bm.pool.take_events()
    assert [e.stored for e in stored] == [True]
    hog = make_request(list(range(300, 308)), BS)
    _admit(bm, hog)
    assert [(e.stored, e.block_hash) for e in bm.pool.take_events()][0] == (
        False,
        stored[0].block_hash,
    )
    bm.free(hog)


def test_block_hashes_are_stable_bytes():
    # Pinned values: a change to the hash breaks router <-> worker agreement across versions.
    h = compute_block_hashes([1, 2, 3, 4], 4)
    assert [x.hex() for x in h] == [
        "2d790034a8dec2c984f9da697f7f0e9cbdee5fddeef98c2119e4a53710057cd2"
    ]
    assert compute_block_hashes([1, 2, 3, 4], 4, cache_salt="x")[0].hex() == (
        "a89b6ff141b7510b04b1d8a851663ad9ef2ff2de6a3810c0b977bcce6c23bf49"
    )
    assert compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[0] == h[0]
    assert compute_block_hashes([1, 2, 3, 4], 4, cache_salt="x")[0] != h[0]
    assert compute_block_hashes([1, 2, 3], 4) == []
