"""A worker's registration in etcd over its life, as real processes on loopback with a real
etcd: a killed worker's lease lapses; SIGTERM drains the work in flight, refuses new work and
deregisters; a worker that loses etcd keeps serving and registers again once etcd is back.
The requests through a prefill + decode pair: test_workers.py."""

import asyncio
import time

import grpc
import pytest
from pd_cluster import WorkerProcess, decode_request, generate

from cluster.etcd_server import EtcdServer
from cluster.registration import list_workers, make_client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


def test_registration_and_lease_expiry_after_kill(etcd, tmp_path):
    async def roles(cluster):
        async with make_client(etcd.endpoint) as client:
            return sorted((w.role, w.worker_id) for w in await list_workers(client, cluster))

    decode = WorkerProcess(
        "decode", etcd.endpoint, "--cluster", "lease", log_dir=tmp_path
    ).wait_ready()
    try:
        [(role, worker_id)] = asyncio.run(roles("lease"))
        assert (role, worker_id) == ("decode", decode.worker_id)
        decode.proc.kill()  # kill -9: no deregistration; the lease must lapse
        decode.proc.wait(10)
        deadline = time.monotonic() + 10
        while asyncio.run(roles("lease")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert asyncio.run(roles("lease")) == []
    finally:
        decode.kill()


def test_sigterm_drains_in_flight_work_then_deregisters(etcd, tmp_path):
    decode = WorkerProcess(
        "decode", etcd.endpoint, "--cluster", "drain", log_dir=tmp_path
    ).wait_ready()

    async def main():
        # Long enough to be in flight well past the SIGTERM on a fast CPU (2 layers decode
        # at a few ms per token), bounded on a slow one.
        task = asyncio.create_task(
            generate(
                decode.address, decode_request("drain", [5] * 20, max_tokens=400, ignore_eos=True)
            )
        )
        await asyncio.sleep(0.3)
        decode.proc.send_signal(15)
        await asyncio.sleep(0.3)
        async with make_client(etcd.endpoint) as client:
            during = await list_workers(client, "drain")
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # no new work while draining
            await generate(decode.address, decode_request("too-late", [5] * 20))
        return await task, during, refused.value.code()

    responses, during, refused_code = asyncio.run(main())
    assert [w.draining for w in during] == [True]
    assert refused_code is grpc.StatusCode.UNAVAILABLE
    assert (
        sum(len(r.token_ids) for r in responses) == 400 and responses[-1].finish_reason == "length"
    )
    assert decode.proc.wait(30) == 0

    async def registered():
        async with make_client(etcd.endpoint) as client:
            return await list_workers(client, "drain")

    assert asyncio.run(registered()) == []


def test_etcd_lost_and_back_keeps_serving_and_reregisters(tmp_path):
    etcd = EtcdServer(data_dir=tmp_path / "etcd").start()
    decode = WorkerProcess(
        "decode", etcd.endpoint, "--cluster", "loss", log_dir=tmp_path
    ).wait_ready()

    async def registered(endpoint, since=0.0):
        async with make_client(endpoint) as client:
            return [w.worker_id for w in await list_workers(client, "loss") if w.updated_at > since]

    try:
        assert asyncio.run(registered(etcd.endpoint)) == [decode.worker_id]
        etcd.stop()
        responses = asyncio.run(
            generate(decode.address, decode_request("no-etcd", [5] * 20, max_tokens=4))
        )
        assert sum(len(r.token_ids) for r in responses) == 4  # still serving without etcd
        etcd = EtcdServer(
            data_dir=tmp_path / "etcd", client_port=etcd.client_port, peer_port=etcd.peer_port
        ).start()
        restarted = time.time()
        deadline = time.monotonic() + 20
        # Published again after the restart (not a key left over from before the outage).
        while asyncio.run(registered(etcd.endpoint, since=restarted)) != [decode.worker_id]:
            assert time.monotonic() < deadline, "the worker did not re-register"
            time.sleep(0.3)
    finally:
        assert decode.terminate() == 0
        etcd.stop()
