"""The chaos run's idle checks (pdserve/chaos/checks.py) against a real etcd, one live
in-process worker and registrations of dead ones (their gRPC address a closed port): they
wait for a dead worker's registration to lapse, and report what never settles instead of
raising."""

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from cluster.etcd_server import EtcdServer
from cluster.grpc_security import OPEN
from cluster.net import free_port
from cluster.registration import WorkerInfo, make_client, worker_key
from pdserve.chaos.checks import index_mismatch, leaked_blocks
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

CLUSTER = "checks"
CACHED = [b"a" * 32, b"b" * 32]


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server.endpoint


@pytest.fixture(scope="module")
def router_url():
    """A router's /metrics as the index check reads it: the index holds len(CACHED) blocks."""

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"pdserve_router_kv_index_blocks {float(len(CACHED))}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


class _IdleWorker(pb_grpc.WorkerServicer):
    async def Health(self, request, context):
        return pb.HealthResponse(capacity=pb.Capacity(total_blocks=8, free_blocks=8))

    async def GetCachedBlocks(self, request, context):
        return pb.CachedBlocksResponse(block_hashes=CACHED)


async def _live_worker() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(_IdleWorker(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server, address


async def _register(client, worker_id: str, address: str, lease=None) -> None:
    info = WorkerInfo(worker_id, "decode", address, "m", "c", 16)
    await client.put(worker_key(CLUSTER, info.role, worker_id), info.to_json(), lease=lease)


async def _with_cluster(etcd: str, body, dead_lease_s: int | None):
    """A live worker and a dead one ("dead": its address is a closed port) registered in a
    fresh cluster prefix; the dead one on a lease of `dead_lease_s` that nobody refreshes (a
    process killed late), or with no lease (a registration that never goes)."""
    server, address = await _live_worker()
    async with make_client(etcd) as client:
        await client.delete_prefix(f"/pdserve/{CLUSTER}/".encode())
        await _register(client, "live", address)
        lease = await client.lease(dead_lease_s) if dead_lease_s else None
        await _register(client, "dead", f"127.0.0.1:{free_port()}", lease)
        try:
            return await body()
        finally:
            await client.delete_prefix(f"/pdserve/{CLUSTER}/".encode())
            await server.stop(None)


def test_the_checks_wait_for_a_dead_workers_registration_to_lapse(etcd, router_url):
    async def body():
        t0 = time.monotonic()
        mismatch = await index_mismatch(router_url, etcd, CLUSTER, OPEN, timeout_s=20)
        waited = time.monotonic() - t0
        leaks = await leaked_blocks(etcd, CLUSTER, OPEN, timeout_s=5)
        return mismatch, waited, leaks

    mismatch, waited, leaks = asyncio.run(_with_cluster(etcd, body, dead_lease_s=2))
    assert mismatch.value == 0 and mismatch.unsettled == {}
    assert waited >= 1.0  # it polled past the refused connection until the lease lapsed
    assert leaks.value == {} and leaks.unsettled == {}


def test_a_worker_that_never_settles_is_reported_not_raised(etcd, router_url):
    async def body():
        t0 = time.monotonic()
        mismatch = await index_mismatch(router_url, etcd, CLUSTER, OPEN, timeout_s=1.5)
        leaks = await leaked_blocks(etcd, CLUSTER, OPEN, timeout_s=1.5)
        return mismatch, leaks, time.monotonic() - t0

    mismatch, leaks, took = asyncio.run(_with_cluster(etcd, body, dead_lease_s=None))
    assert took >= 3.0  # both waited out their bound
    for check in (mismatch, leaks):
        assert set(check.unsettled) == {"dead"}
        assert check.unsettled["dead"].startswith("UNAVAILABLE")
    assert mismatch.value == 0  # the live worker's cache is what the router indexed
    assert leaks.value == {}


def test_an_unreachable_router_or_etcd_is_reported_not_raised(etcd):
    async def body():
        return await index_mismatch(
            f"http://127.0.0.1:{free_port()}", etcd, CLUSTER, OPEN, timeout_s=0.5
        )

    mismatch = asyncio.run(_with_cluster(etcd, body, dead_lease_s=None))
    assert mismatch.value == -1 and {"dead", "router"} == set(mismatch.unsettled)
    gone = asyncio.run(leaked_blocks(f"127.0.0.1:{free_port()}", CLUSTER, OPEN, timeout_s=0.5))
    assert gone.value == {} and set(gone.unsettled) == {"etcd"}
