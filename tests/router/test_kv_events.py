"""KV subscriptions against fake workers: snapshot first, then events; a worker leaving drops
its entries; a fresh router (restart) rebuilds the index from snapshots."""

import asyncio

from router_fakes import FakeWorker
from router_harness import wait_for

from cluster.grpc_security import OPEN
from engine.kv.block_hash import compute_block_hashes
from router.channels import ChannelPool
from router.placement.events import KVSubscriptions
from router.placement.index import KVIndex

H = compute_block_hashes(list(range(160)), 16)  # 10 blocks


def blocks(match):
    return {w: hit.blocks for w, hit in match.items()}


async def _subscribed(worker):
    index, channels = KVIndex(), ChannelPool(OPEN)
    subs = KVSubscriptions(index, channels)
    subs.on_added(worker.info())
    await asyncio.wait_for(subs.synced[worker.worker_id].wait(), 5)
    return index, channels, subs


async def _close(subs, channels, *workers):
    await subs.close()
    await channels.close_all()
    for w in workers:
        await w.stop()


def test_snapshot_then_events_then_removal(bg):
    async def main():
        w = await FakeWorker("prefill", "", "", "p1").start(register=False)
        w.store(H[:4])  # cached before the router subscribed: must come from the snapshot
        index, channels, subs = await _subscribed(w)
        assert blocks(index.match(H)) == {"p1": 4}
        w.store(H[4:8])
        await wait_for(lambda: blocks(index.match(H)) == {"p1": 8})
        w.evict([H[2]])
        await wait_for(lambda: blocks(index.match(H)) == {"p1": 2})
        subs.on_removed(w.info())
        assert blocks(index.match(H)) == {} and len(index) == 0
        await _close(subs, channels, w)

    bg.run(main())


def test_tiers_arrive_with_events_and_snapshots(bg):
    async def main():
        w = await FakeWorker("decode", "", "", "d1").start(register=False)
        w.set_capacity(kv_offload_total_blocks=100)
        w.store(H[:6])
        w.demote(H[4:6])  # before the router subscribed: the snapshot's tiers say so
        index, channels, subs = await _subscribed(w)
        assert index.match(H) == {"d1": (6, 2)}
        w.demote(H[2:4])
        await wait_for(lambda: index.match(H) == {"d1": (6, 4)})
        w.evict(H[5:6])
        await wait_for(lambda: index.match(H) == {"d1": (5, 3)})
        await _close(subs, channels, w)

    bg.run(main())


def test_restart_rebuilds_from_snapshots(bg):
    async def main():
        a = await FakeWorker("prefill", "", "", "pa").start(register=False)
        b = await FakeWorker("decode", "", "", "db").start(register=False)
        a.store(H)
        b.store(H[:3])
        first = [await _subscribed(w) for w in (a, b)]
        for index, channels, subs in first:  # the old router goes away
            await subs.close()
            await channels.close_all()
        a.evict(H[6:])  # changes while no router listens
        index, channels = KVIndex(), ChannelPool(OPEN)
        subs = KVSubscriptions(index, channels)
        for w in (a, b):
            subs.on_added(w.info())
        await asyncio.wait_for(asyncio.gather(*(subs.synced[i].wait() for i in ("pa", "db"))), 5)
        assert blocks(index.match(H)) == {"pa": 6, "db": 3}
        await subs.close()
        await channels.close_all()
        await a.stop()
        await b.stop()

    bg.run(main())


def test_worker_restart_resubscribes(bg):
    async def main():
        w = await FakeWorker("decode", "", "", "d1").start(register=False)
        w.store(H[:5])
        index, channels, subs = await _subscribed(w)
        port = w.address.rsplit(":", 1)[1]
        await w.stop()  # the stream breaks: entries dropped, retries begin
        await wait_for(lambda: blocks(index.match(H)) == {})
        w2 = FakeWorker("decode", "", "", "d1")  # same id and address: a restarted worker
        w2.cached = list(H[:2])
        await w2.start(register=False, port=int(port))
        await wait_for(lambda: blocks(index.match(H)) == {"d1": 2}, timeout=8)
        await subs.close()
        await channels.close_all()
        await w2.stop()

    bg.run(main(), timeout=30)


def test_a_worker_gets_no_more_of_the_index_than_its_registered_capacity(bg):
    """A worker (or whoever registered as one) that sends stores without end cannot grow the
    index beyond the blocks it registered: the excess is dropped and counted."""

    async def main():
        w = await FakeWorker("decode", "", "", "d1").start(register=False)
        w.set_capacity(total_blocks=4, free_blocks=4, kv_offload_total_blocks=2)
        many = compute_block_hashes(list(range(16 * 50)), 16)  # 50 blocks
        w.store(many[:6])  # the snapshot holds 6: 4 are indexed
        index, channels, subs = await _subscribed(w)
        assert index.num_blocks("d1") == 4 and index.dropped["d1"] == 2
        w.store(many[6:])
        await wait_for(lambda: index.dropped["d1"] == 46)
        assert index.num_blocks("d1") == 4 and len(index) == 4
        w.demote(many[:3])  # the tier holds 2: the third leaves the index
        await wait_for(lambda: index.dropped["d1"] == 47)
        assert sorted(index.blocks_of("d1").values()) == [0, 1, 1]
        w.evict([many[3], many[10]])  # room again in the pool
        w.store(many[10:11])
        await wait_for(lambda: many[10] in index.blocks_of("d1"))
        assert index.blocks_of("d1") == {many[0]: 1, many[1]: 1, many[10]: 0}
        subs.on_removed(w.info())
        assert len(index) == 0 and "d1" not in index.dropped
        await _close(subs, channels, w)

    bg.run(main())
