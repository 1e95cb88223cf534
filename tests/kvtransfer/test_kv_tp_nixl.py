"""Transfers between tensor-parallel workers of different sizes over real NIXL agents in this
process (UCX loopback): a worker is one backend (rank 0) plus a `RankAgent` per other rank,
joined by an in-process group channel. After a transfer every destination rank's pool holds
exactly its heads of the source blocks, byte for byte, and nothing else changed."""

import os
import time
from types import SimpleNamespace

import pytest
import torch

from engine.parallel.shard import head_split
from kvtransfer import KVCompat, KVTransferConfig, NixlTransferBackend, TransferStatus
from kvtransfer.heads import HeadRange
from kvtransfer.rank_agent import RankLink

pytestmark = pytest.mark.timeout(60)

LAYERS, BLOCK, HD = 2, 4, 8
_count = iter(range(1000))


class Worker:
    """A worker of `size` ranks holding `full` (its whole-layout pool) split by head_split."""

    def __init__(self, full: torch.Tensor, size: int, n_heads: int):
        n_kv = full.shape[4]
        self.full = full
        self.ranges = [
            HeadRange(s.kv.start, s.kv.stop)
            for s in (head_split(n_heads, n_kv, size, r) for r in range(size))
        ]
        self.pools = [full[:, :, :, :, r.start : r.stop].contiguous() for r in self.ranges]
        self.ctx = [
            SimpleNamespace(rank=r, kv_cache=p, services={}) for r, p in enumerate(self.pools)
        ]
        link = RankLink(self.ranges, self._call) if size > 1 else None
        name = f"tp-{os.getpid()}-{next(_count)}"
        self.backend = NixlTransferBackend(KVTransferConfig(agent_name=name), link)
        compat = KVCompat("m", "float32", BLOCK, LAYERS, n_kv, HD)
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
            out[:, :, :, :, r.start : r.stop] = pool
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
    full = torch.randn((blocks, LAYERS, 2, BLOCK, n_kv, HD), generator=g)
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
            want = expected[:, :, :, :, rng.start : rng.stop]
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
