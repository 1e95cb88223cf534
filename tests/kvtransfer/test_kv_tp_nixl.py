"""Transfers between tensor-parallel workers of different sizes over real NIXL agents in this
process (UCX loopback): a worker is one backend (rank 0) plus a `RankAgent` per other rank,
joined by an in-process group channel. After a transfer every destination rank's pool holds
exactly its heads of the source blocks, byte for byte, and nothing else changed."""

import os
import random
import time
from types import SimpleNamespace

import pytest
import torch

from engine.kv import kv_format
from engine.kv.block_pool import BlockPool
from engine.parallel.shard import head_split
from kvtransfer import KVCompat, KVTransferConfig, NixlTransferBackend, TransferStatus
from kvtransfer.heads import HeadRange, plan_slices
from kvtransfer.rank_agent import RankLink

pytestmark = pytest.mark.timeout(60)

LAYERS, BLOCK, HD = 2, 4, 8
_count = iter(range(1000))


class Worker:
    """A worker of `size` ranks holding `full` (its whole-layout pool) split by head_split."""

    def __init__(self, full: torch.Tensor, size: int, n_heads: int, kv_cache_dtype="auto"):
        n_kv = full.shape[1]
        self.full = full
        self.ranges = [
            HeadRange(s.kv.start, s.kv.stop)
            for s in (head_split(n_heads, n_kv, size, r) for r in range(size))
        ]
        self.pools = [full[:, r.start : r.stop].contiguous() for r in self.ranges]
        self.ctx = [
            SimpleNamespace(rank=r, kv_cache=p, services={}) for r, p in enumerate(self.pools)
        ]
        link = RankLink(self.ranges, self._call) if size > 1 else None
        name = f"tp-{os.getpid()}-{next(_count)}"
        self.backend = NixlTransferBackend(KVTransferConfig(agent_name=name), link)
        compat = KVCompat.for_pool(full, "m", kv_cache_dtype)
        self.meta = self.backend.register_pool(self.pools[0], compat)

    def _call(self, task):
        out = [task.run_on_rank(c) for c in self.ctx[1:]]
        return out if task.gather else None

    def agents(self):
        return [c.services["kv_rank_agent"] for c in self.ctx[1:]]

    def close(self):
        self.backend.close()
        for c in self.ctx[1:]:
            for s in c.services.values():
                s.close()

    def view(self) -> torch.Tensor:
        """The whole-layout pool as the ranks hold it now (first holder of each head)."""
        out = torch.zeros_like(self.full)
        for r, pool in zip(reversed(self.ranges), reversed(self.pools)):
            out[:, r.start : r.stop] = pool
        return out


def transfer(p: Worker, d: Worker, pairs, rid, batches=1, deadline_s=10.0):
    p.backend.add_peer(d.meta.to_bytes())
    d.backend.receiver.expect(rid, [b for _, b in pairs], deadline=time.monotonic() + deadline_s)
    chunks = [pairs[i::batches] for i in range(batches)]
    for i, chunk in enumerate(chunks):
        p.backend.sender.send(
            rid,
            d.meta.agent_name,
            chunk,
            final=i == batches - 1,
            deadline=time.monotonic() + deadline_s,
        )
    got_s, got_r = {}, {}
    end = time.monotonic() + deadline_s + 5
    while (rid not in got_s or rid not in got_r) and time.monotonic() < end:
        got_s.update((r.request_id, r) for r in p.backend.sender.poll())
        got_r.update((r.request_id, r) for r in d.backend.receiver.poll())
        time.sleep(0.0005)
    return got_s[rid], got_r[rid]


def make(blocks, n_kv, size, seed, n_heads=None):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn((blocks, n_kv, LAYERS, 2, BLOCK, HD), generator=g)
    return Worker(full, size, n_heads or 4 * n_kv)


@pytest.mark.parametrize(
    "n_kv, a, b",
    [
        (3, 1, 1),
        (3, 1, 2),
        (3, 2, 1),
        (3, 2, 2),
        (3, 3, 2),
        (1, 1, 2),
        (1, 2, 1),
        (1, 2, 2),
        (2, 4, 1),
        (2, 1, 4),
    ],
)
def test_each_destination_rank_gets_exactly_its_heads(n_kv, a, b):
    p, d = make(12, n_kv, a, seed=1), make(16, n_kv, b, seed=2)
    try:
        before = d.view().clone()
        replicas_before = [pool.clone() for pool in d.pools]
        pairs = [(1, 15), (2, 3), (7, 0), (11, 8), (4, 9)]
        s, r = transfer(p, d, pairs, "r1", batches=2)
        assert s.status is TransferStatus.COMPLETE and r.status is TransferStatus.COMPLETE, (s, r)
        assert r.num_blocks == len(pairs)
        expected = before.clone()
        for src, dst in pairs:
            expected[dst] = p.full[src]
        for j, (rng, pool) in enumerate(zip(d.ranges, d.pools)):  # every replica written
            want = expected[:, rng.start : rng.stop]
            assert torch.equal(pool, want), f"destination rank {j}"
            untouched = [i for i in range(16) if i not in {x for _, x in pairs}]
            assert torch.equal(pool[untouched], replicas_before[j][untouched])
        assert p.backend.sender.num_outstanding_writes == 0
        assert all(a.num_in_flight == 0 for a in p.agents())
    finally:
        p.close()
        d.close()


def test_a_dead_destination_fails_the_request_and_releases_every_rank():
    p, d = make(8, 3, 2, seed=3), make(8, 3, 1, seed=4)
    try:
        p.backend.add_peer(d.meta.to_bytes())
        d.close()  # the destination's agent is gone
        p.backend.sender.send(
            "x", d.meta.agent_name, [(1, 2), (3, 4)], final=True, deadline=time.monotonic() + 3
        )
        end, results = time.monotonic() + 10, []
        while not results and time.monotonic() < end:
            results = p.backend.sender.poll()
            time.sleep(0.001)
        assert results and results[0].status.failed
        assert p.backend.sender.num_outstanding_writes == 0
        assert all(a.num_in_flight == 0 for a in p.agents())
    finally:
        p.close()


def test_tp_metadata_round_trips_and_single_pool_metadata_is_unchanged():
    from kvtransfer import PeerMetadata

    p, d = make(4, 3, 2, seed=5), make(4, 3, 1, seed=6)
    try:
        back = PeerMetadata.from_bytes(p.meta.to_bytes())
        assert back == p.meta and back.head_ranges() == [HeadRange(0, 2), HeadRange(2, 3)]
        assert b'"ranks"' not in d.meta.to_bytes() and b'"heads"' not in d.meta.to_bytes()
        assert p.meta.compat_hash == d.meta.compat_hash  # the layout is the model's, not the size's
    finally:
        p.close()
        d.close()


# ---- coalesced plans: adjacent blocks move as one region per rank --------------------------
def make_format(blocks, n_kv, size, seed, kv_cache_dtype):
    """A worker whose pool stores `kv_cache_dtype` KV (random bytes in its storage dtype)."""
    storage = kv_format.storage_dtype(kv_cache_dtype, torch.float32)
    stored = kv_format.stored_head_dim(kv_cache_dtype, HD)
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, n_kv, LAYERS, 2, BLOCK, stored * storage.itemsize)
    raw = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    return Worker(raw.view(storage), size, 4 * n_kv, kv_cache_dtype)


def pool_ids(num_blocks, n, fragmented, seed):
    """n block ids as the engine's pool hands them out: fresh, or after allocation churn."""
    pool = BlockPool(num_blocks)
    if fragmented:
        rng = random.Random(seed)
        held = []
        for _ in range(120):
            k = rng.randint(1, 6)
            if pool.num_free_blocks - k >= n + 8:
                held.append(pool.reserve(k))
            if held and rng.random() < 0.5:
                pool.release(list(reversed(held.pop(rng.randrange(len(held))))))
    return pool.reserve(n)


def runs(pairs):
    """Runs of block pairs adjacent on both sides, ordered by source block."""
    pairs = sorted(pairs)
    return 1 + sum(1 for (a, b), (c, e) in zip(pairs, pairs[1:]) if (c, e) != (a + 1, b + 1))


def descriptors(w: Worker) -> list[int]:
    """NIXL descriptors each rank of `w` has posted."""
    return [w.backend.sender.metrics.transfers.descriptors] + [
        a.writer.descriptors_posted for a in w.agents()
    ]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
@pytest.mark.parametrize("fragmented", [False, True], ids=["fresh", "fragmented"])
@pytest.mark.parametrize("a, b", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 2)])
def test_pools_are_byte_exact_after_a_coalesced_transfer(a, b, fragmented, kv_cache_dtype):
    n, n_kv = 20, 3
    p = make_format(48, n_kv, a, seed=11, kv_cache_dtype=kv_cache_dtype)
    d = make_format(56, n_kv, b, seed=12, kv_cache_dtype=kv_cache_dtype)
    try:
        local = pool_ids(48, n, fragmented, seed=13)
        remote = pool_ids(56, n, fragmented, seed=14)
        pairs = list(zip(local, remote))
        before = [as_bytes(pool).clone() for pool in d.pools]
        s, r = transfer(p, d, pairs, "c1")
        assert s.status is TransferStatus.COMPLETE and r.status is TransferStatus.COMPLETE, (s, r)
        full = as_bytes(p.full)
        for j, (rng, pool) in enumerate(zip(d.ranges, d.pools)):
            want = before[j].clone()
            want[remote] = full[local][:, rng.start : rng.stop]
            assert torch.equal(as_bytes(pool), want), f"destination rank {j}"
        if a == b:  # whole slices: one region per run, on every rank
            assert descriptors(p) == [runs(pairs)] * a
            assert fragmented or runs(pairs) == 1
        # A slice of a block (heads first in a block) is one region: per source rank, one
        # descriptor per (block, slice) — per (run, slice) where the slice is every head of
        # both pools — never one per (block, layer, K/V, token) row.
        expected = [0] * a
        for sl in plan_slices(p.ranges, d.ranges):
            expected[sl.src_rank] += runs(pairs) if sl.whole else n
        assert descriptors(p) == expected, (descriptors(p), expected)
        if a != b:
            assert sum(expected) < n * LAYERS * 2 * BLOCK
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("size", [1, 2])
def test_a_contiguous_64_block_request_moves_in_one_region_per_rank(size):
    p, d = make(80, 3, size, seed=15), make(72, 3, size, seed=16)
    try:
        local, remote = pool_ids(80, 64, False, 0), pool_ids(72, 64, False, 0)
        s, r = transfer(p, d, list(zip(local, remote)), "c64")
        assert s.status is TransferStatus.COMPLETE and r.status is TransferStatus.COMPLETE
        assert all(x <= 2 for x in descriptors(p)), descriptors(p)
        assert s.num_descriptors == descriptors(p)[0]
        assert torch.equal(d.view()[remote], p.full[local])
        transfers = p.backend.sender.metrics.transfers
        assert transfers.transfers == 1
        assert transfers.bytes == 64 * p.pools[0].stride(0) * p.pools[0].element_size()
    finally:
        p.close()
        d.close()
