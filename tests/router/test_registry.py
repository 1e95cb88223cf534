"""Worker registry from a real etcd: workers appear and disappear with their leases, stale
capacity ages out, draining workers stay listed but get no work, a restart rebuilds."""

import asyncio
import json

from router_fakes import FakeWorker
from router_harness import wait_for

from cluster.registration import Capacity, WorkerInfo
from router.placement.registry import EtcdWatcher, WorkerRegistry, parse_key


def _watch(etcd, cluster, **kw):
    registry = WorkerRegistry(**kw)
    task = asyncio.get_running_loop().create_task(
        EtcdWatcher(registry, etcd.endpoint, cluster, resync_after_s=1.0).run()
    )
    return registry, task


def test_workers_appear_update_and_disappear(etcd, bg, cluster_name):
    async def main():
        registry, task = _watch(etcd, cluster_name)
        added, removed = [], []
        registry.add_listener(
            lambda i: added.append(i.worker_id), lambda i: removed.append(i.worker_id)
        )
        d = await FakeWorker("decode", etcd.endpoint, cluster_name, "d1").start()
        p = await FakeWorker("prefill", etcd.endpoint, cluster_name, "p1").start()
        await wait_for(lambda: len(registry.all()) == 2)
        assert [w.info.grpc_address for w in registry.by_role("decode")] == [d.address]
        d.set_capacity(running=5)
        await wait_for(lambda: registry.get("d1").info.capacity.running == 5)
        await d.stop()  # deregisters: gone at once
        await wait_for(lambda: registry.get("d1") is None)
        await p.stop(deregister=False)  # dies silently: gone when its 2 s lease lapses
        await wait_for(lambda: registry.get("p1") is None, timeout=6)
        assert added == ["d1", "p1"] and removed == ["d1", "p1"]
        task.cancel()

    bg.run(main(), timeout=30)


def test_stale_capacity_ages_out_and_draining_is_reported(etcd, bg, cluster_name):
    async def main():
        registry, task = _watch(etcd, cluster_name, stale_after_s=0.5)
        d = await FakeWorker("decode", etcd.endpoint, cluster_name, "d1").start()
        await wait_for(lambda: registry.get("d1") is not None)
        assert not registry.is_stale(registry.get("d1"))
        d.registrar._task.cancel()  # stops republishing; the lease is still alive for a while
        await wait_for(lambda: registry.is_stale(registry.get("d1")), timeout=3)
        # A re-listing (resync) must not make an old registration look fresh again.
        await asyncio.sleep(1.2)
        assert registry.get("d1") is None or registry.is_stale(registry.get("d1"))
        d2 = await FakeWorker("decode", etcd.endpoint, cluster_name, "d2", draining=True).start()
        await wait_for(lambda: registry.get("d2") is not None)
        assert registry.get("d2").info.draining
        await d2.stop()
        await d.stop(deregister=False)
        task.cancel()

    bg.run(main(), timeout=30)


def test_restart_rebuilds_from_etcd_and_ignores_other_models(etcd, bg, cluster_name):
    async def main():
        workers = [
            await FakeWorker(role, etcd.endpoint, cluster_name, wid).start()
            for role, wid in [("decode", "d1"), ("decode", "d2"), ("prefill", "p1")]
        ]
        other = await FakeWorker(
            "decode", etcd.endpoint, cluster_name, "x", model_id="other"
        ).start()
        registry, task = _watch(
            etcd,
            cluster_name,
            refusal=lambda info: "other model" if info.model_id == "other" else None,
        )
        await wait_for(lambda: registry.synced.is_set())
        assert sorted(w.info.worker_id for w in registry.all()) == ["d1", "d2", "p1"]
        task.cancel()
        for w in [*workers, other]:
            await w.stop()

    bg.run(main(), timeout=30)


def test_registry_replace_all_and_key_parsing():
    async def main():
        registry = WorkerRegistry()

        def info(wid, addr="a:1"):
            return WorkerInfo(wid, "decode", addr, "m", "c", 16, capacity=Capacity(total_blocks=1))

        registry.replace_all([info("a"), info("b")])
        registry.replace_all([info("b", "b:2")])  # a gone; b restarted at another address
        assert [(w.info.worker_id, w.info.grpc_address) for w in registry.all()] == [("b", "b:2")]

    asyncio.run(main())
    prefix = b"/pdserve/c/workers/"
    assert parse_key(prefix + b"decode/w-1", prefix) == ("decode", "w-1")
    assert parse_key(prefix + b"other/w-1", prefix) is None
    assert parse_key(prefix + b"decode/", prefix) is None


def test_a_worker_switching_roles_moves_keys_without_leaving(etcd, bg, cluster_name):
    """Registrar.move puts the new role's key, then deletes the old one (same lease): the
    registry sees one worker change role in place — no leave, so its KV-index entries
    (dropped only by the removal listener) and this router's load on it are kept."""

    async def main():
        from cluster.registration import list_workers, make_client

        registry, task = _watch(etcd, cluster_name)
        added, removed = [], []
        registry.add_listener(
            lambda i: added.append(i.worker_id), lambda i: removed.append(i.worker_id)
        )
        w = await FakeWorker("prefill", etcd.endpoint, cluster_name, "w1").start()
        await wait_for(lambda: registry.get("w1") is not None)
        registry.get("w1").inflight = 2
        w.role = "decode"
        await w.registrar.move("prefill")
        await wait_for(lambda: registry.get("w1").info.role == "decode")
        await asyncio.sleep(0.5)  # the old key's DELETE event, a few republications
        state = registry.get("w1")
        assert state is not None and state.info.role == "decode" and state.inflight == 2
        assert [s.info.worker_id for s in registry.ready("decode")] == ["w1"]
        assert registry.by_role("prefill") == [] and added == ["w1"] and removed == []
        async with make_client(etcd.endpoint) as client:
            keys = [kv.key for kv in await client.get_prefix(f"/pdserve/{cluster_name}/".encode())]
            assert keys == [f"/pdserve/{cluster_name}/workers/decode/w1".encode()]
            assert [i.role for i in await list_workers(client, cluster_name)] == ["decode"]
        await w.stop()
        await wait_for(lambda: registry.get("w1") is None)
        assert removed == ["w1"]
        task.cancel()

    bg.run(main(), timeout=30)


def test_the_old_key_deleted_in_either_order_never_removes_the_new_role():
    async def main():
        registry = WorkerRegistry()
        removed = []
        registry.add_listener(lambda i: None, lambda i: removed.append(i.worker_id))
        info = lambda role, addr="a:1": WorkerInfo("w", role, addr, "m", "c", 16)  # noqa: E731
        registry.put(info("prefill"))
        registry.put(info("decode"))  # new key first (what Registrar.move does)
        registry.delete("w", role="prefill")  # then the old key: not this registration
        assert registry.get("w").info.role == "decode" and removed == []
        registry.delete("w", role="decode")  # the old key first (another writer's order)
        assert registry.get("w") is None and removed == ["w"]
        registry.put(info("prefill"))
        registry.put(info("decode", "a:2"))  # another address: a restart, a new worker
        assert registry.get("w").info.grpc_address == "a:2" and removed == ["w", "w"]

    asyncio.run(main())


def test_a_worker_first_seen_draining_gets_no_channel_until_it_is_ready():
    """The added-listeners open the KV subscription (a channel carrying the cluster token):
    a registration marked draining from its first sight gets none, this router placed nothing
    on it; one seen ready first keeps its subscription while it drains."""

    async def main():
        registry = WorkerRegistry()
        added, removed = [], []
        registry.add_listener(
            lambda i: added.append(i.worker_id), lambda i: removed.append(i.worker_id)
        )

        def info(wid, draining):
            return WorkerInfo(wid, "decode", f"{wid}:1", "m", "c", 16, draining=draining)

        registry.put(info("d", draining=True))
        assert registry.get("d") is not None and registry.state_of(registry.get("d")) == "draining"
        assert added == [] and registry.ready("decode") == []
        registry.delete("d")
        assert removed == []  # nothing was opened, nothing to close
        registry.put(info("e", draining=True))
        registry.put(info("e", draining=False))  # ready now: subscribed once
        registry.put(info("e", draining=True))
        registry.put(info("e", draining=True))
        assert added == ["e"]
        registry.delete("e")
        assert removed == ["e"]

    asyncio.run(main())


def test_a_forged_registration_is_not_listed_and_an_accepted_one_that_turns_bad_leaves(
    etcd, bg, cluster_name
):
    async def main():
        from cluster.registration import make_client, worker_key

        registry, task = _watch(etcd, cluster_name)
        good = WorkerInfo("d1", "decode", "127.0.0.1:5", "m", "c", 16)
        async with make_client(etcd.endpoint) as client:
            forged = json.loads(good.to_json())
            forged["capacity"] = {"total_blocks": -1}
            await client.put(worker_key(cluster_name, "decode", "x1"), json.dumps(forged).encode())
            # a document naming another worker than its key
            await client.put(worker_key(cluster_name, "decode", "x2"), good.to_json())
            await client.put(worker_key(cluster_name, "decode", "d1"), good.to_json())
            await wait_for(lambda: registry.get("d1") is not None)
            assert [w.info.worker_id for w in registry.all()] == ["d1"]
            await client.put(worker_key(cluster_name, "decode", "d1"), json.dumps(forged).encode())
            await wait_for(lambda: registry.get("d1") is None)
            assert registry.all() == []
        task.cancel()

    bg.run(main(), timeout=30)
