"""A worker whose engine loop dies exits non-zero (for its supervisor to restart it) and
leaves etcd at once, instead of hanging with its gRPC port closed while still registered.

The engine is broken from outside through a worker extension (tests/e2e/admin_extension.py)
that frees the KV pool behind the worker's back, as `CollectiveRPC("sleep")` could before
collective_rpc was confined to extensions (refused here too); the next prompt's step raises."""

import asyncio
import os
import time

import grpc
import pytest
from admin_extension import EXTENSION_PATH, SPEC
from pd_cluster import WorkerProcess

from cluster.etcd_server import EtcdServer
from cluster.registration import list_workers, make_client
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


async def _registered(etcd: str) -> list[str]:
    async with make_client(etcd) as client:
        return [w.worker_id for w in await list_workers(client, "default")]


def test_a_dead_engine_loop_ends_the_process_and_its_registration(tmp_path, monkeypatch):
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [EXTENSION_PATH, os.environ.get("PYTHONPATH")]))
    )
    with EtcdServer() as etcd:
        worker = WorkerProcess(
            "decode",
            etcd.endpoint,
            "--enable-sleep-mode",
            "--enable-admin-rpcs",
            "--worker-extension-cls",
            SPEC,
            log_dir=tmp_path,
        )
        try:
            worker.wait_ready()
            assert asyncio.run(_registered(etcd.endpoint)) == [worker.worker_id]

            async def break_the_engine() -> grpc.StatusCode:
                async with grpc.aio.insecure_channel(worker.address) as ch:
                    admin = pb_grpc.WorkerStub(ch)
                    try:  # the engine's own methods are not reachable over the network
                        await admin.CollectiveRPC(
                            pb.CollectiveRPCRequest(method="sleep"), timeout=10
                        )
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, exc
                        assert "not a method of the worker extension" in exc.details()
                    else:
                        raise AssertionError("CollectiveRPC('sleep') reached the engine")
                    await admin.CollectiveRPC(
                        pb.CollectiveRPCRequest(method="break_kv_pool"), timeout=10
                    )
                    request = pb.GenerateRequest(
                        request_id="r",
                        prompt_token_ids=list(range(100, 300)),
                        sampling=pb.SamplingParams(max_tokens=4),
                    )
                    try:
                        async for _ in pb_grpc.DecodeWorkerStub(ch).Generate(request, timeout=30):
                            pass
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()
                    return grpc.StatusCode.OK

            assert asyncio.run(break_the_engine()) is grpc.StatusCode.UNAVAILABLE
            deadline = time.monotonic() + 20
            while worker.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert worker.exit_code() == 1, "the worker did not exit after its engine loop died"
            assert asyncio.run(_registered(etcd.endpoint)) == []  # deregistered, not lapsed
            assert "engine loop died" in worker.log_path.read_text()
        finally:
            if worker.alive():
                worker.kill()
