"""Blocks that slid out of every layer's window go back to the pool (BlockManager with
`group_windows`): a long sequence holds about a window's blocks, a prefix hit and a remote
prompt never take the early ones, a prefill worker keeps what it streams, and everything
comes back when the request ends. Greedy parity of such a model with transformers, in a pool
too small for its history, is in tests/models/test_arch_parity.py."""

import pytest
from engine_factories import drain, make_request, make_scheduler, step

from engine.core.limits import RequestRejected
from engine.core.request import RequestStatus
from engine.kv.block_manager import RELEASED, BlockManager
from engine.processing.tokens import SampledToken

BS, W = 4, 8


def _held(bm, r):
    return [b for b in bm.block_table(r.request_id) if b != RELEASED]


def test_decoding_releases_blocks_behind_the_window():
    bm = BlockManager(32, BS, group_windows=(W,))
    r = make_request(6, BS, max_tokens=64)
    assert bm.allocate(r, 6, bm.match_prefix(r))
    r.num_computed_tokens = 6
    for token in range(40):
        r.append_token(token)
        assert bm.append_slots(r, 1)
        table = bm.block_table(r.request_id)
        first = max(0, r.num_computed_tokens - W + 1) // BS  # the window of this step's query
        assert table[:first] == [RELEASED] * first
        assert RELEASED not in table[first:]
        assert len(_held(bm, r)) <= -(-W // BS) + 1
        r.num_computed_tokens += 1
    bm.free(r)
    assert bm.pool.num_free_blocks == 32


def test_no_window_releases_nothing():
    bm = BlockManager(32, BS)
    r = make_request(30, BS)
    assert bm.allocate(r, 30, bm.match_prefix(r))
    r.num_computed_tokens = 30
    r.append_token(1)
    assert bm.append_slots(r, 1)
    assert RELEASED not in bm.block_table(r.request_id)


def test_a_prefix_hit_takes_only_the_blocks_its_window_reads():
    bm = BlockManager(32, BS, group_windows=(W,))
    first = make_request(list(range(1, 26)), BS)  # 6 full blocks + 1 token
    assert bm.allocate(first, 25, bm.match_prefix(first))
    first.num_computed_tokens = 25
    bm.cache_full_blocks(first)
    bm.free(first)
    second = make_request(list(range(1, 26)), BS)
    prefix = bm.match_prefix(second)
    assert prefix.num_tokens == 24
    free_before = bm.pool.num_free_blocks
    assert bm.allocate(second, 1, prefix)
    table = bm.block_table(second.request_id)
    skip = (24 - W + 1) // BS  # the query at 24 reads keys 17..24
    assert table[:skip] == [RELEASED] * skip and table[skip:6] == prefix.block_ids[0][skip:]
    assert bm.pool.num_free_blocks == free_before - (7 - skip)
    bm.free(second)
    assert bm.pool.num_free_blocks == 32


def test_forks_share_held_blocks_and_free_everything():
    bm = BlockManager(32, BS, group_windows=(W,))
    parent = make_request(20, BS)
    assert bm.allocate(parent, 20, bm.match_prefix(parent))
    parent.num_computed_tokens = 20
    parent.append_token(3)
    assert bm.append_slots(parent, 1)
    child = make_request(20, BS)
    bm.fork(parent, child)
    assert bm.block_table(child.request_id) == bm.block_table(parent.request_id)
    assert RELEASED in bm.block_table(child.request_id)
    bm.free(parent)
    bm.free(child)
    assert bm.pool.num_free_blocks == 32


def test_a_streaming_prefill_keeps_its_blocks_from_keep_blocks_from():
    bm = BlockManager(32, BS, group_windows=(W,))
    r = make_request(40, BS)
    r.keep_blocks_from = [2]
    assert bm.allocate(r, 16, bm.match_prefix(r))
    r.num_computed_tokens = 16
    assert bm.append_slots(r, 16)
    r.num_computed_tokens = 32
    assert bm.append_slots(r, 8)
    table = bm.block_table(r.request_id)
    assert table[:2] == [RELEASED, RELEASED] and RELEASED not in table[2:]


def test_remote_prompt_needs_only_the_first_decode_window():
    s = make_scheduler(num_blocks=16, block_size=BS, group_windows=(W,))
    r = make_request(list(range(100, 130)), BS)  # 30 tokens: 8 blocks
    needed = s.allocate_for_remote_kv(r)
    first = (30 - W + 1) // BS  # the first decode query (position 30) reads keys 23..30
    table = s.bm.block_table(r.request_id)
    assert table[:first] == [RELEASED] * first and needed == table[first:]
    assert r.remote_skip_blocks == [first]  # what the prefill worker does not send
    s.remote_kv_arrived(r.request_id, SampledToken(42))
    drain(s)
    assert s.bm.pool.num_free_blocks == 16


def test_a_prompt_longer_than_the_pool_fits_with_a_window():
    """Without the window the 200-token prompt needs 51 blocks of a 12-block pool."""
    plain = make_scheduler(num_blocks=12, block_size=BS, max_num_batched_tokens=16)
    with pytest.raises(RequestRejected, match="needs 51 KV blocks"):
        plain.add_request(make_request(200, BS))
    s = make_scheduler(num_blocks=12, block_size=BS, max_num_batched_tokens=16, group_windows=(W,))
    r = make_request(200, BS, max_tokens=20)
    s.add_request(r)
    for _ in range(100):
        step(s)
        if r.status.is_finished:
            break
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 20
    assert s.stats.num_preemptions == 0 and s.bm.pool.num_free_blocks == 12


# ---- layers that mix full and sliding attention: one table per KV group ------------------------
def test_kv_groups_cut_layers_of_one_kind_into_equal_groups():
    from engine.kv.kv_groups import KVGroups

    gemma3 = KVGroups.from_windows([None if (i + 1) % 6 == 0 else 512 for i in range(18)])
    assert gemma3.group_size == 3 and gemma3.windows == (None, 512, 512, 512, 512, 512)
    assert gemma3.layers[0] == (5, 11, 17) and gemma3.layers[1] == (0, 1, 2)
    assert gemma3.layers[2] == (3, 4, 6)  # layer 5 is a full one
    assert gemma3.place(11) == (0, 1) and gemma3.place(4) == (2, 1)
    uniform = KVGroups.from_windows([None] * 4)
    assert uniform.layers == ((0, 1, 2, 3),) and uniform.group_size == 4
    uneven = KVGroups.from_windows([None, 8, 8, None, 8])  # 2 full, 3 sliding: size 2
    assert uneven.layers == ((0, 3), (1, 2), (4,)) and uneven.windows == (None, 8, 8)


def test_a_full_group_keeps_the_history_while_a_sliding_group_releases():
    bm = BlockManager(64, BS, group_windows=(None, W))
    r = make_request(6, BS, max_tokens=64)
    assert bm.allocate(r, 6, bm.match_prefix(r))
    r.num_computed_tokens = 6
    for token in range(30):
        r.append_token(token)
        assert bm.append_slots(r, 1)
        r.num_computed_tokens += 1
    full, sliding = bm.block_tables(r.request_id)
    assert RELEASED not in full and len(full) == -(-r.num_tokens // BS)
    first = max(0, r.num_computed_tokens - 1 - W + 1) // BS
    assert sliding[:first] == [RELEASED] * first and first > 0
    assert set(full).isdisjoint(b for b in sliding if b != RELEASED)
    assert bm.pool.num_free_blocks == 64 - len(full) - (len(sliding) - first)
    bm.free(r)
    assert bm.pool.num_free_blocks == 64


def test_a_hybrid_prefix_hit_needs_only_the_sliding_groups_window():
    bm = BlockManager(64, BS, group_windows=(None, W))
    first = make_request(list(range(1, 26)), BS)
    assert bm.allocate(first, 25, bm.match_prefix(first))
    first.num_computed_tokens = 25
    bm.cache_full_blocks(first)
    bm.free(first)
    # The sliding group lost its oldest blocks (evicted); the window of position 24 is intact.
    sliding_table = first.block_tables[1]
    for i in range(2):
        bm.pool.blocks[sliding_table[i]].block_hash = None
        del bm.pool._cached[1][first.block_hashes[i]]
    second = make_request(list(range(1, 26)), BS)
    prefix = bm.match_prefix(second)
    assert prefix.num_tokens == 24
    skip = (24 - W + 1) // BS
    assert prefix.block_ids[0] == first.block_tables[0][:6]
    assert prefix.block_ids[1] == [RELEASED] * skip + sliding_table[skip:6]
    assert bm.allocate(second, 1, prefix)
    bm.free(second)
    # Lose a block inside the window too: the hit shrinks to where the window is whole.
    del bm.pool._cached[1][first.block_hashes[5]]
    bm.pool.blocks[sliding_table[5]].block_hash = None
    assert bm.match_prefix(make_request(list(range(1, 26)), BS)).num_tokens < 24


def test_a_hybrid_remote_prompt_gets_each_groups_blocks_after_its_own_skip():
    s = make_scheduler(num_blocks=32, block_size=BS, group_windows=(None, W))
    r = make_request(list(range(100, 130)), BS)  # 30 tokens: 8 blocks per group
    needed = s.allocate_for_remote_kv(r)
    full, sliding = s.bm.block_tables(r.request_id)
    first = (30 - W + 1) // BS  # the first decode query (position 30) reads keys 23..30
    assert r.remote_skip_blocks == [0, first]  # the full group needs the whole prompt
    assert RELEASED not in full and sliding[:first] == [RELEASED] * first
    assert needed == full + sliding[first:]  # group after group
    assert s.bm.pool.num_free_blocks == 32 - 8 - (8 - first)
    s.remote_kv_arrived(r.request_id, SampledToken(42))
    drain(s)
    assert s.bm.pool.num_free_blocks == 32
