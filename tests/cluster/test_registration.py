import asyncio
import time
from dataclasses import replace

import pytest

from cluster.etcd_server import EtcdServer
from cluster.registration import (
    Capacity,
    EtcdUnavailable,
    Registrar,
    WorkerInfo,
    list_workers,
    make_client,
)


@pytest.fixture
def etcd():
    with EtcdServer() as server:
        yield server


def _info(free=10, draining=False):
    return WorkerInfo(
        "w1",
        "decode",
        "127.0.0.1:1",
        "m",
        "hash",
        16,
        draining=draining,
        capacity=Capacity(total_blocks=20, free_blocks=free),
    )


def test_register_refresh_and_deregister(etcd):
    async def main():
        state = {"free": 10}
        reg = Registrar(
            etcd.endpoint, "t", lambda: _info(state["free"]), ttl_s=2, publish_interval_s=0.05
        )
        await reg.start()
        async with make_client(etcd.endpoint) as c:
            [w] = await list_workers(c, "t")
            assert w.worker_id == "w1" and w.capacity.free_blocks == 10 and w.updated_at > 0
            state["free"] = 3
            await asyncio.sleep(0.3)
            [w] = await list_workers(c, "t")
            assert w.capacity.free_blocks == 3  # capacity republished
            await asyncio.sleep(2.5)  # longer than the TTL: the lease was kept alive
            assert len(await list_workers(c, "t")) == 1
            await reg.deregister()
            assert await list_workers(c, "t") == []

    asyncio.run(main())


def test_unreachable_etcd_is_a_clear_error():
    async def main():
        from cluster.net import free_port

        reg = Registrar(f"127.0.0.1:{free_port()}", "t", _info)
        t0 = time.monotonic()
        with pytest.raises(EtcdUnavailable, match="cannot register"):
            await reg.start(timeout_s=2)
        assert time.monotonic() - t0 < 5

    asyncio.run(main())


def test_the_first_registration_waits_for_an_etcd_that_comes_up_late():
    """A worker starting beside a slow etcd (its first calls fail or time out) registers once
    etcd answers, within the start's deadline, instead of failing its start."""
    from cluster.net import free_port

    async def main():
        port = free_port()
        reg = Registrar(f"127.0.0.1:{port}", "t", _info, ttl_s=2)
        starting = asyncio.create_task(reg.start(timeout_s=30))
        await asyncio.sleep(1.0)
        assert not starting.done()  # still trying, not failed
        with EtcdServer(client_port=port) as etcd:
            await starting
            async with make_client(etcd.endpoint) as c:
                assert [w.worker_id for w in await list_workers(c, "t")] == ["w1"]
            await reg.deregister()

    asyncio.run(main())


def test_registration_round_trips_as_json():
    info = _info(draining=True)
    assert WorkerInfo.from_json(info.to_json()) == info
    with pytest.raises(ValueError, match="role"):
        WorkerInfo.from_json(info.to_json().replace(b'"decode"', b'"other"'))


class _SlowPutClient:
    """In-process stand-in for an etcd client whose put waits for a gate (only for this test)."""

    def __init__(self) -> None:
        self.keys: dict[bytes, bytes] = {}
        self.gate = asyncio.Event()
        self.put_started = asyncio.Event()

    async def put(self, key, value, lease=None):
        self.put_started.set()
        await self.gate.wait()
        self.keys[key] = value

    async def delete(self, key):
        self.keys.pop(key, None)


def test_a_role_move_during_a_publication_of_the_old_role_still_deletes_the_old_key():
    """The race CI hit: a periodic publication reads role=prefill, the role switches and
    move() retires the prefill key while that put is in flight; the stale publication must
    not take the retirement back, or the prefill key stays on the live lease for good."""

    async def main():
        role = {"now": "prefill"}
        reg = Registrar("unused:0", "t", lambda: replace(_info(), role=role["now"]))
        client = _SlowPutClient()
        reg._client = client
        stale = asyncio.create_task(reg._publish())  # reads role=prefill, waits in put
        await client.put_started.wait()
        role["now"] = "decode"
        mover = asyncio.create_task(reg.move("prefill"))
        await asyncio.sleep(0.01)
        client.gate.set()
        await asyncio.gather(stale, mover)
        assert list(client.keys) == [b"/pdserve/t/workers/decode/w1"]

    asyncio.run(main())
