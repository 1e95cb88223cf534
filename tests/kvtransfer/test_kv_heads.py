"""Planning a transfer between pools that hold different KV heads (kvtransfer/heads.py):
exact slices for every pair of tensor-parallel sizes, replicas read once and written to every
holder, and descriptors that address exactly those bytes."""

import numpy as np
import pytest

from engine.parallel.shard import head_split
from kvtransfer.heads import HeadRange, PoolGeometry, Slice, check_ranges, plan_slices, slice_descs


def ranges(n_kv: int, size: int, n_heads: int | None = None) -> list[HeadRange]:
    n_heads = n_heads or 4 * n_kv
    return [
        HeadRange(s.kv.start, s.kv.stop)
        for s in (head_split(n_heads, n_kv, size, r) for r in range(size))
    ]


@pytest.mark.parametrize(
    "a, b, expected",
    [
        (1, 1, [Slice(0, 0, 0, 0, 3, True)]),
        # the default model's 3 KV heads: 2 + 1 at tp 2
        (1, 2, [Slice(0, 0, 0, 0, 2, False), Slice(0, 1, 2, 0, 1, False)]),
        (2, 1, [Slice(0, 0, 0, 0, 2, False), Slice(1, 0, 0, 2, 1, False)]),
        (2, 2, [Slice(0, 0, 0, 0, 2, True), Slice(1, 1, 0, 0, 1, True)]),
        (
            3,
            2,
            [Slice(0, 0, 0, 0, 1, False), Slice(1, 0, 0, 1, 1, False), Slice(2, 1, 0, 0, 1, True)],
        ),
    ],
)
def test_slices_for_three_kv_heads(a, b, expected):
    assert plan_slices(ranges(3, a), ranges(3, b)) == expected


def test_replicated_heads_read_once_written_to_every_replica():
    one = ranges(1, 1)  # [0, 1)
    two = ranges(1, 2)  # both ranks hold head 0
    assert two == [HeadRange(0, 1), HeadRange(0, 1)]
    assert plan_slices(one, two) == [Slice(0, 0, 0, 0, 1, True), Slice(0, 1, 0, 0, 1, True)]
    # a replicated source: one replica read per destination rank (round-robin by rank)
    assert plan_slices(two, one) == [Slice(0, 0, 0, 0, 1, True)]
    assert plan_slices(two, two) == [Slice(0, 0, 0, 0, 1, True), Slice(1, 1, 0, 0, 1, True)]
    # 2 KV heads over 4 ranks (each replicated twice) -> 1 rank holding both
    four, single = ranges(2, 4), ranges(2, 1)
    assert four == [HeadRange(0, 1), HeadRange(0, 1), HeadRange(1, 2), HeadRange(1, 2)]
    assert plan_slices(four, single) == [Slice(0, 0, 0, 0, 1, False), Slice(2, 0, 0, 1, 1, False)]
    got = plan_slices(single, four)
    assert [(s.dst_rank, s.src_head, s.num_heads) for s in got] == [
        (0, 0, 1),
        (1, 0, 1),
        (2, 1, 1),
        (3, 1, 1),
    ]


def test_every_destination_head_comes_from_a_holder_exactly_once():
    for n_kv in (1, 2, 3, 4, 6):
        sizes = [s for s in (1, 2, 3, 4, 6, 8) if n_kv % s == 0 or s % n_kv == 0]
        for a in sizes:
            for b in sizes:
                src, dst = ranges(n_kv, a, 24), ranges(n_kv, b, 24)
                got = {}
                for s in plan_slices(src, dst):
                    for k in range(s.num_heads):
                        head = dst[s.dst_rank].start + s.dst_head + k
                        assert src[s.src_rank].start + s.src_head + k == head
                        assert (s.dst_rank, head) not in got
                        got[(s.dst_rank, head)] = s.src_rank
                assert set(got) == {
                    (j, h) for j, d in enumerate(dst) for h in range(d.start, d.stop)
                }


def test_missing_heads_are_refused():
    with pytest.raises(ValueError):
        check_ranges([HeadRange(0, 1), HeadRange(2, 3)], 3)
    with pytest.raises(ValueError):
        plan_slices([HeadRange(0, 2)], [HeadRange(0, 3)])


def test_descriptors_address_exactly_the_slice_bytes():
    # [blocks, heads, layers=2, 2, block_size=4, head_dim=8] float32, as flat byte buffers
    rows, hd, esize = 2 * 2 * 4, 8, 4
    src_pool = np.arange(5 * 3 * rows * hd, dtype=np.float32).reshape(5, 3, rows, hd)
    dst_pool = np.zeros((6, 2, rows, hd), dtype=np.float32)
    src = PoolGeometry(0, 3, 0, rows, hd * esize)
    dst = PoolGeometry(0, 2, 0, rows, hd * esize)
    (s,) = [
        x
        for x in plan_slices([HeadRange(0, 3)], [HeadRange(0, 2), HeadRange(2, 3)])
        if x.dst_rank == 1
    ]  # head 2 of the source -> head 0 of destination rank 1
    local, remote = np.array([1, 4]), np.array([5, 0])
    sd, dd = slice_descs(s, src, dst, local, remote)
    # heads first in a block: one region per block, not one per (layer, K/V, token) row
    assert len(sd) == len(dd) == 2 and (sd[:, 1] == rows * hd * esize).all()
    flat_src, flat_dst = src_pool.reshape(-1).view(np.uint8), dst_pool.reshape(-1).view(np.uint8)
    for (sa, n, _), (da, _, _) in zip(sd, dd):
        flat_dst[da : da + n] = flat_src[sa : sa + n]
    expected = np.zeros_like(dst_pool)
    expected[[5, 0], 0] = src_pool[[1, 4], 2]
    assert np.array_equal(dst_pool, expected)
    whole = Slice(0, 0, 0, 0, 3, True)
    sd, dd = slice_descs(whole, src, PoolGeometry(1000, 3, 0, rows, hd * esize), local, remote)
    assert sd[:, 0].tolist() == [src.block_bytes, 4 * src.block_bytes]
    assert dd[:, 0].tolist() == [1000 + 5 * src.block_bytes, 1000]
